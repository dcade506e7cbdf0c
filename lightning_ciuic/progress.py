"""The training progress bar counts the batches the run will take, where ``max_steps`` ends it inside an epoch.

Lightning's bars count an epoch's batches, bounded by ``max_steps`` only when ``max_epochs`` is -1: the shipped
configs set ``max_epochs``, so ``lightning-ciuic fit --trainer.max_steps 5`` showed ``5/200`` and an ETA for 200
batches. Contract: :func:`bound_to_max_steps` turns the Trainer's own bar (Lightning's TQDM or Rich bar, as
Lightning chose it, with its settings) into one whose epoch total is the smaller of the epoch's batches and the
batches the remaining optimizer steps take (``(max_steps - global_step) * accumulate_grad_batches``); other bars
are left as they are. The console script applies it before ``fit``.
"""

from __future__ import annotations

from typing import Optional, Union

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar


class MaxStepsBound:
    """Mixin for a Lightning progress bar: see the module docstring."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        trainer = self.trainer  # type: ignore[attr-defined]
        total = trainer.num_training_batches
        if trainer.max_steps is not None and trainer.max_steps > 0:
            total = min(total, (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches)
        return total


class MaxStepsBoundTQDMProgressBar(MaxStepsBound, TQDMProgressBar):
    pass


class MaxStepsBoundRichProgressBar(MaxStepsBound, RichProgressBar):
    pass


_BOUND = {TQDMProgressBar: MaxStepsBoundTQDMProgressBar, RichProgressBar: MaxStepsBoundRichProgressBar}


def bound_to_max_steps(bar: Optional[ProgressBar]) -> None:
    """Make ``bar`` (a Trainer's ``progress_bar_callback``) count to ``max_steps``, in place; a no-op for any other bar."""
    bound = _BOUND.get(type(bar))  # exactly Lightning's class: a user's own subclass keeps its own total
    if bound is not None:
        bar.__class__ = bound
