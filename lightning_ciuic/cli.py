"""The ``lightning-ciuic`` console script: LightningCLI with every class of the pack available by name.

``lightning-ciuic fit --config examples/configs/demo.yaml`` trains the main job. Any LightningModule and
LightningDataModule can be named in the YAML (``class_path``); the current directory is put on
``sys.path`` first (as uvicorn and pytest do) so a project's own modules, such as ``examples.deepseek``,
resolve without being installed.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

import lightning_ciuic  # noqa: F401  (registers the strategy names and classes)


def main(args: Optional[list[str]] = None) -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
