"""Lightning's and LitData's private parts the pack touches (see :mod:`lightning_ciuic.compat`): the launchers and
what a spawned rank is handed, a ``LightningOptimizer``'s optimizer, the fit loop's counters, the restore's end, a
LightningModule's device mesh; LitData's distributed environment. Lightning is imported inside the functions (the
framework-free floors import :mod:`lightning_ciuic.compat`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def launchers() -> tuple[type, type, type]:
    """Lightning's subprocess-script launcher, its multiprocessing launcher (whose ``_wrapping_function`` and
    ``_collect_rank_zero_results`` ours overrides) and the ``_WorkerOutput`` the latter returns."""
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
    from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput

    return _SubprocessScriptLauncher, _MultiProcessingLauncher, _WorkerOutput


def spawn_handoff() -> tuple[type, Any]:
    """What Lightning's launcher does for a ``spawn`` rank only, and ours for a ``forkserver`` rank too: the
    ``_GlobalStateSnapshot`` (deterministic flags, random states) it restores in the rank, and
    ``_disable_module_memory_sharing`` (a module pickled to a CPU rank arrives in shared memory; the rank clones it)."""
    from lightning.pytorch.strategies.launchers.multiprocessing import (
        _disable_module_memory_sharing,
        _GlobalStateSnapshot,
    )

    return _GlobalStateSnapshot, _disable_module_memory_sharing


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def optimizers_of(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers of what a ``configure_optimizers()`` returned, in any of Lightning's forms (Lightning's own
    reading of them)."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    return list(_configure_optimizers(configured)[0])


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    strategy._reset_optimizers_and_schedulers()


def set_logged_batch_size(trainer: Any, batch_size: int) -> None:
    """The batch size ``self.log(..., on_epoch=True)`` weighs this step's values by (else taken from the batch)."""
    results = getattr(trainer, "_results", None)
    if results is not None:
        results.batch_size = batch_size


def batch_index(trainer: Any) -> int:
    """The index of the running batch within its epoch."""
    return trainer.fit_loop.epoch_loop.batch_idx


def epoch_position(trainer: Any) -> tuple[int, int]:
    """(epochs processed, batches processed in the running epoch) of the fit loop: ``(e, 0)`` between epochs. Once
    the fit loop has counted an epoch processed (at its end, or when ``max_steps`` ends training mid-epoch), the
    epoch loop's batch counters still hold that epoch's batches: they are not the next epoch's."""
    epochs = trainer.fit_loop.epoch_progress.current
    running = epochs.started > epochs.processed
    return epochs.processed, trainer.fit_loop.epoch_loop.batch_progress.current.processed if running else 0


def set_batches_processed(trainer: Any, batches: int) -> bool:
    """Make the running epoch's batch counters say ``batches`` processed (ready, started, processed and completed
    moved alike, so a restart mid-batch keeps its shape); between epochs, nothing. Returns whether they moved."""
    epochs = trainer.fit_loop.epoch_progress.current
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = batches - current.processed
    if epochs.started <= epochs.processed or not shift:
        return False
    for counter in ("ready", "started", "processed", "completed"):
        setattr(current, counter, getattr(current, counter) + shift)
    return True


# Lightning calls ``strategy.barrier`` by this name once ``fit``'s checkpoint restore is over (a ``ckpt_path`` or
# none), before the sanity check and the fit loop: the end of the restore that nothing public marks.
RESTORE_DONE_BARRIER = "_CheckpointConnector.resume_end"


def load_pending_loader_states(trainer: Any) -> None:
    """Give training loaders that were set up before a restore the states the restore brought (Lightning loads them
    only when it sets a loader up: issue #20550). A no-op when nothing is pending or no loader is set up yet."""
    trainer.fit_loop._load_combined_loader_states()


def rewind_step_counters(trainer: Any, loops: dict[str, Any]) -> None:
    """Set the optimizer-step totals and the logging step from a saved ``fit_loop.state_dict()``."""
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]
    epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.load_state_dict(automatic)
    manual = loops["epoch_loop.manual_optimization.optim_step_progress"]["total"]
    epoch_loop.manual_optimization.optim_step_progress.total.load_state_dict(manual)
    epoch_loop._batches_that_stepped = loops["epoch_loop.state_dict"]["_batches_that_stepped"]


def litdata_distributed_env(world_size: int, global_rank: int, num_nodes: int) -> Any:
    """A LitData ``_DistributedEnv``: the world a ``StreamingDataset`` assigns chunks over."""
    from litdata.utilities.env import _DistributedEnv

    return _DistributedEnv(world_size=world_size, global_rank=global_rank, num_nodes=num_nodes)


def set_litdata_world(dataset: Any, env: Any) -> Any:
    """Make ``dataset`` (a ``StreamingDataset``) split over ``env``; returns the environment it had."""
    before, dataset.distributed_env = dataset.distributed_env, env
    return before


@contextmanager
def litdata_detects(env: Any) -> Iterator[None]:
    """Inside, LitData's ``_DistributedEnv.detect()`` returns ``env`` (``StreamingDataLoader.load_state_dict`` compares
    the saved world size with the one it detects)."""
    from litdata.utilities.env import _DistributedEnv

    original = _DistributedEnv.__dict__["detect"]
    _DistributedEnv.detect = classmethod(lambda cls: env)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _DistributedEnv.detect = original  # type: ignore[method-assign]


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns (``LightningModule._device_mesh``, Lightning 2.4+; set by
    ``ModelParallelStrategy`` the same way)."""
    module._device_mesh = mesh


def litdata_children(dataset: Any) -> list[Any]:
    """The datasets a LitData combined/parallel dataset holds (``_datasets``, litdata 0.2); ``[]`` for any other."""
    return list(getattr(dataset, "_datasets", []))


def set_launcher(strategy: Any, launcher: Any) -> None:
    """The launcher a strategy starts its processes with (``Strategy._launcher``, Lightning 2.x; set in
    ``_configure_launcher`` as DDPStrategy does)."""
    strategy._launcher = launcher


def layer_sync(strategy: Any) -> Any:
    """The layer sync ``Trainer(sync_batchnorm=True)`` gave the strategy (``Strategy._layer_sync``, Lightning 2.x), or None."""
    return strategy._layer_sync


def precision_plugin_given(strategy: Any) -> Any:
    """The precision plugin a strategy holds, or None where none was set (``Strategy._precision_plugin``, Lightning
    2.x: its public property then makes a new ``Precision()`` on every read)."""
    return strategy._precision_plugin


def set_precision_plugin(strategy: Any, plugin: Any) -> None:
    """Where a strategy keeps its precision plugin (``Strategy._precision_plugin``, Lightning 2.x), for a strategy
    whose ``precision_plugin`` property is its own (as ``FSDPStrategy``'s and ``DeepSpeedStrategy``'s are)."""
    strategy._precision_plugin = plugin
