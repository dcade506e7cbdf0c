"""One way for callbacks to change the training DataLoader Lightning prepares.

:func:`add_train_loader_transform` puts a function ``(trainer, loader) -> loader`` in a list kept on the strategy,
and the strategy's ``process_dataloader`` (Lightning's hook for a strategy's data logic) applies the list, in
the order added, to training loaders only. :func:`remove_train_loader_transform` takes it out; the strategy's
own method is back once the list is empty. Any order of adding and removing is safe.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage

Transform = Callable[[Trainer, Any], Any]
_ATTRIBUTE = "_lightning_ciuic_train_loader_transforms"


def add_train_loader_transform(trainer: Trainer, transform: Transform) -> None:
    strategy = trainer.strategy
    transforms: list[Transform] = vars(strategy).setdefault(_ATTRIBUTE, [])
    if not transforms:
        original = type(strategy).process_dataloader.__get__(strategy)

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            if trainer.state.stage == RunningStage.TRAINING:
                for apply in list(transforms):
                    dataloader = apply(trainer, dataloader)
            return dataloader

        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]
    if transform not in transforms:
        transforms.append(transform)


def remove_train_loader_transform(trainer: Trainer, transform: Transform) -> None:
    strategy = trainer.strategy
    transforms: list[Transform] = vars(strategy).get(_ATTRIBUTE, [])
    if transform in transforms:
        transforms.remove(transform)
    if not transforms and "process_dataloader" in vars(strategy):
        del strategy.process_dataloader
