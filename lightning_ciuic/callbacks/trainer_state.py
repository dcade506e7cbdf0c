"""A running Trainer's whole training state, captured and written back, for snapshots.

Contract:

* :func:`capture_training_state`: this rank's share of the model and of every optimizer's state (live CPU tensors:
  serialize them before the next step), LR schedulers, the data-parallel engine's per-rank state and mode
  (:func:`~lightning_ciuic.comm.data_parallel.engine_state`: residuals, DiLoCo's round; under its key, as in checkpoints),
  the fit loop's state (step, epoch, position in the epoch, stateful loaders), every callback's state but
  ``skip``'s, and the RNG states. Only public objects are read (``trainer.optimizers``, ``lr_scheduler_configs``,
  ``fit_loop.state_dict()``, callbacks' ``state_dict``), not Lightning's private checkpoint connector.
* :func:`apply_training_state` writes such a state back, in place. ``rewind_only`` (an in-process rollback): the
  loops keep their data position and only the step counters go back — the one private attribute touched is the
  epoch loop's ``_batches_that_stepped`` (the logging step). Otherwise (a restart) the whole loop state and the
  callbacks' states are loaded, as ``fit(ckpt_path=...)`` would. ``rank_state=False``: the state is another
  rank's (a data-parallel replica), so this rank's compression residuals start from zero.
* :func:`apply_lightning_checkpoint` applies a Lightning checkpoint dict read by ``strategy.load_checkpoint`` the
  way ``fit(ckpt_path=...)`` does: weights, optimizers, schedulers, loops and callbacks.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_ciuic.checkpoint.training_state import (
    capture_module,
    capture_optimizer,
    restore_module,
    restore_optimizer,
    rng_state,
    set_rng_state,
)
from lightning_ciuic import compat
from lightning_ciuic.comm.data_parallel import ENGINE_STATE_KEY, engine_state, restore_engine_state
from lightning_ciuic.strategies.context import parallel_context


def capture_training_state(trainer: Trainer, pl_module: LightningModule, skip: Optional[Callback] = None) -> dict[str, Any]:
    engine = parallel_context(trainer).data_parallel
    return {
        "module": capture_module(pl_module, copy=False),
        "optimizers": [capture_optimizer(o, copy=False) for o in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "loops": trainer.fit_loop.state_dict(),
        "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks if cb is not skip},
        ENGINE_STATE_KEY: engine_state(engine),  # residuals, DiLoCo's round: per rank
        "rng": rng_state(),
    }


def apply_training_state(
    trainer: Trainer,
    pl_module: LightningModule,
    state: dict[str, Any],
    rewind_only: bool,
    rank_state: bool = True,
    skip: Optional[Callback] = None,
) -> None:
    restore_module(pl_module, state["module"])
    for optimizer, captured in zip(trainer.optimizers, state["optimizers"]):
        restore_optimizer(optimizer, captured)
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
        config.scheduler.load_state_dict(scheduler_state)
    context = parallel_context(trainer)
    engine = context.data_parallel
    if engine is not None:  # another rank's or layout's state: the engine starts afresh (residuals zero)
        restore_engine_state(engine, state[ENGINE_STATE_KEY] if rank_state else None)
    set_rng_state(state["rng"])
    check = context.batch_check
    if check is not None:  # the next batch after a restore is compared again (data/check.py)
        check.arm()
    if rewind_only:
        compat.rewind_step_counters(trainer, state["loops"])
        return
    trainer.fit_loop.load_state_dict(state["loops"])
    _load_callback_states(trainer, state["callbacks"], skip)


def apply_lightning_checkpoint(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    strategy = trainer.strategy
    if "state_dict" in checkpoint:
        strategy.load_model_state_dict(checkpoint, strict=True)
    if "optimizer_states" in checkpoint:
        strategy.load_optimizer_state_dict(checkpoint)
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers", [])):
        config.scheduler.load_state_dict(scheduler_state)
    if "loops" in checkpoint:
        trainer.fit_loop.load_state_dict(checkpoint["loops"]["fit_loop"])
    _load_callback_states(trainer, checkpoint.get("callbacks", {}), skip=None)


def _load_callback_states(trainer: Trainer, states: dict[str, Any], skip: Optional[Callback]) -> None:
    for callback in trainer.callbacks:
        if callback is not skip and callback.state_key in states:
            callback.load_state_dict(states[callback.state_key])
