"""The one point of ``fit`` where its restored state is final, for strategies that restore after set-up.

Lightning restores ``fit(ckpt_path=...)`` into a strategy with ``restore_checkpoint_after_setup`` (ours: the model
is parallelized first) *after* every ``on_fit_start`` hook, and nothing public marks the end of that restore. Two
things went wrong without such a point, silently:

* a callback that calls ``trainer.estimated_stepping_batches`` (``WarmupCosineSchedule``, a user's
  ``OneCycleLR`` in ``configure_optimizers``) makes Lightning set up the training loader before the restore, and
  Lightning then never gives that loader its saved position (Lightning issue #20550): the resumed epoch starts
  over, repeating the batches it had trained;
* a callback that decides by itself whether to resume (``SnapshotRecovery``) cannot tell whether ``ckpt_path``
  will be loaded, nor rely on the loader's set-up coming after its own ``on_fit_start``.

Contract: :func:`restore_done` runs once per ``fit`` on every rank, after Lightning's restore (with or without a
``ckpt_path``) and before the sanity check and the fit loop. It calls ``on_fit_restored(trainer, pl_module)`` on
every callback that has one, in the callbacks' order (a collective there runs on every rank alike), then loads
the saved positions into training loaders already set up, and keeps the step training starts from in the
strategy's ``fit_start_step`` (what ``fit`` trained is ``trainer.global_step`` minus it). :data:`ANNOUNCES_RESTORE`
on a strategy says it calls :func:`restore_done`.
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_ciuic import compat

ANNOUNCES_RESTORE = "announces_fit_restored"


def announces_restore(trainer: Trainer) -> bool:
    """Whether ``trainer``'s strategy calls :func:`restore_done` (else a callback decides at ``on_fit_start``)."""
    return bool(getattr(trainer.strategy, ANNOUNCES_RESTORE, False))


def restore_done(trainer: Trainer) -> None:
    """See the module docstring; a no-op outside ``fit``."""
    if trainer.state.fn != TrainerFn.FITTING:
        return
    for callback in trainer.callbacks:
        hook = getattr(callback, "on_fit_restored", None)
        if hook is not None:
            hook(trainer, trainer.lightning_module)
    compat.load_pending_loader_states(trainer)
    trainer.strategy.fit_start_step = trainer.global_step
