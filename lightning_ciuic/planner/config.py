"""What a plan reads from a LightningCLI config: the module, the strategy's layout, the precision.

Contract: :func:`from_config` parses ``RUN.yaml`` (and command-line overrides such as
``--trainer.strategy.init_args.expert_parallel_size 64``) with the very parser ``lightning-ciuic fit`` uses,
instantiates the model on the meta device (nothing allocated, whatever its size) and the strategy, and returns a
:class:`RunConfig`. No Trainer is built, so a config for GPUs plans on a machine without any. The strategy must be a
:class:`~lightning_ciuic.HybridParallelStrategy` (its layout is what is planned); anything else is refused, saying
what to write; that refusal, and a class of the config refusing its arguments, are
:class:`~lightning_ciuic.cli_parsing.ConfigError` s (``ValueError`` s). :func:`module_factory` gives, for each rank the
planner builds, a fresh copy of the module with the mesh set and ``configure_model()`` run, as the strategy's set-up
does; :func:`optimizers_of` the module's optimizers as ``configure_optimizers()`` returns them, in any of Lightning's
forms.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_ciuic import compat
from lightning_ciuic.config import MIXED_PRECISION_DTYPES, ParallelismConfig
from lightning_ciuic.planner.layout import ModuleFactory

PRECISION_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}



@dataclass
class RunConfig:
    """A run's module (on the meta device), layout and precision."""

    module: nn.Module
    parallelism: ParallelismConfig
    precision: str = "32-true"

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype FSDP2 gathers parameters in and autocast computes in (mixed precision), else ``None``."""
        return MIXED_PRECISION_DTYPES.get(self.precision)


def from_config(config: Optional[str], cli_args: Sequence[str] = ()) -> RunConfig:
    """Parse a LightningCLI config (see the module docstring)."""
    from lightning_ciuic.cli_parsing import ConfigCLI, ConfigError
    from lightning_ciuic.strategies.hybrid import HybridParallelStrategy

    class PlanCLI(ConfigCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--ckpt_path", default=None, help="read as fit reads it; the plan does not resume")

        def instantiate_trainer(self, **kwargs: Any) -> None:  # type: ignore[override]
            return None

    args = [*(["--config", str(config)] if config else []), *cli_args]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
        # datamodule_class=None: ``data`` may be any LightningDataModule, or absent (a plan reads no data)
        cli = PlanCLI(LightningModule, None, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args,
            seed_everything_default=False,
        )
    trainer = cli.config_init["trainer"]
    strategy = trainer.get("strategy")
    if not isinstance(strategy, HybridParallelStrategy):
        raise ConfigError(
            f"plan reads the layout of lightning_ciuic.HybridParallelStrategy, and this config's trainer.strategy is"
            f" {strategy!r}: set trainer.strategy.class_path: lightning_ciuic.HybridParallelStrategy with the degrees"
            " in its init_args (pipeline_parallel_size, tensor_parallel_size, data_parallel_shard_size, ...)."
        )
    precision = str(trainer.get("precision") or "32-true")
    precision = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true"}.get(precision, precision)
    return RunConfig(cli.model, strategy.parallelism.with_precision(precision), precision)


def module_factory(run: RunConfig) -> ModuleFactory:
    """A fresh copy of the run's module for each rank: dtype of a ``*-true`` precision, the mesh set,
    ``configure_model()`` run on the meta device (what the strategy's set-up does before parallelizing). It pickles
    (the module on the meta device: no weights), for the step phase's worker processes."""
    return ModuleCopies(run)


@dataclass
class ModuleCopies:
    """:func:`module_factory`'s factory: ``ModuleCopies(run)(mesh)`` is a fresh copy of ``run.module`` for one rank."""

    run: RunConfig

    def __call__(self, mesh: Any) -> nn.Module:
        module = copy.deepcopy(self.run.module)
        dtype = PRECISION_DTYPES.get(self.run.precision)
        if dtype is not None:
            module = module.to(dtype)
        if isinstance(module, LightningModule):
            compat.set_module_device_mesh(module, mesh)
            with torch.device("meta"):
                module.configure_model()
        return module


def optimizers_of(module: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers ``module.configure_optimizers()`` returns (none for a module without the method)."""
    configure = getattr(module, "configure_optimizers", None)
    if configure is None:
        return []
    return [compat.unwrap_optimizer(o) for o in compat.optimizers_of(configure())]
