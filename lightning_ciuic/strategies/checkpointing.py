"""How :class:`~lightning_ciuic.strategies.hybrid.HybridParallelStrategy` writes, reads and removes checkpoints.

Contract (collective calls, every rank with the same path, but for the two state functions):

* :func:`model_state` / :func:`optimizer_state`: the state Lightning puts in a checkpoint: as Lightning keeps it where
  every rank holds it whole, else by torch's state-dict API (DTensor shards under the unsplit model's names); saving
  an optimizer's state runs no optimizer step and clears no gradient.
* ``save_checkpoint(strategy, checkpoint, filepath, storage_options)`` (``storage_options`` must be ``None``: a
  ``TypeError`` otherwise): with a :class:`ChunkedCheckpointIO` (``AsyncCheckpointer``)
  that manages ``filepath``, the state is staged now and written in the background as chunks. Otherwise, where
  every rank holds the whole state (:func:`whole_on_every_rank`: no pipeline stages, no tensor-parallel, expert or
  FSDP shards, no per-rank engine state), it is Lightning's ordinary single-file checkpoint, written by rank zero through
  the strategy's ``CheckpointIO`` (``LightningModule.load_from_checkpoint`` and ``torch.load`` read it, as they read
  ``DDPStrategy``'s). Else it is a ``torch.distributed.checkpoint`` directory at ``filepath``, tensors sharded per
  rank under the unsplit model's parameter names; Lightning's non-tensor state travels inside as one object;
  per-rank state (compression residuals) under a key of this rank and :meth:`ParallelDims.layout_key`. The dict
  the caller passed (what ``on_save_checkpoint`` hooks saw and edited) is not changed.
* ``load_checkpoint(strategy, path)`` arms the replica's batch check (the restored loaders' first batch is compared
  again) and loads any of the three into the already set-up model and optimizers, whatever
  (pp, dp, tp) layout wrote it, honouring ``LightningModule.strict_loading`` (strict: a checkpoint of another
  architecture, with parameters this model lacks or lacking some it has, fails naming them), and returns
  Lightning's whole checkpoint dict, ``state_dict`` and ``optimizer_states`` included, as ``on_load_checkpoint``
  hooks expect. Residuals written by another rank or layout are not loaded: they start at zero. Its error (a damaged
  or missing checkpoint, a storage error, strict loading) is raised once, by the lowest rank that had it, the other
  ranks stopping quietly (:func:`~lightning_ciuic.parallel.shutdown.reported_once`).
* The first sharded directory a strategy writes is followed by one line (rank zero) saying how to read it:
  ``Trainer.fit(ckpt_path=...)``, or ``lightning-ciuic checkpoint export`` for ``load_from_checkpoint``.
* ``remove_checkpoint(strategy, filepath)`` deletes one (global rank zero).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lightning_ciuic.comm.data_parallel import ENGINE_STATE_KEY, engine_state, restore_engine_state
from lightning_ciuic.checkpoint import sharded
from lightning_ciuic.checkpoint.sharded import load_sharded, load_whole, optimizer_state_by_name, save_sharded
from lightning_ciuic.compat import unwrap_optimizer
from lightning_ciuic.parallel.shutdown import reported_once
from lightning_ciuic.plugins.checkpoint_io import ChunkedCheckpointIO

if TYPE_CHECKING:
    import torch

    from lightning_ciuic.strategies.hybrid import HybridParallelStrategy


def rank_key(strategy: HybridParallelStrategy) -> str:
    """Per-rank state (compression residuals) belongs to one rank of one layout (``ParallelDims.layout_key``): another
    layout resets it."""
    dims = strategy.parallel_dims
    layout = dims.layout_key(strategy.global_rank) if dims is not None else "single"
    return f"rank{strategy.global_rank}_{layout}_state"


def _chunked_io(strategy: HybridParallelStrategy, path: Any) -> ChunkedCheckpointIO | None:
    io = strategy.checkpoint_io
    return io if isinstance(io, ChunkedCheckpointIO) and io.manages(path) else None


def whole_on_every_rank(strategy: HybridParallelStrategy) -> bool:
    """Whether every rank holds the whole training state: no pipeline stages, no tensor-parallel or FSDP shards, no
    per-rank engine state. Such a run writes and reads Lightning's ordinary single-file checkpoint."""
    dims, parallelized, engine = strategy.parallel_dims, strategy.parallelized, strategy.data_parallel
    if dims is None:  # no layout here: the launching process, handed the whole model after a spawned fit
        return True
    if dims.pp_enabled or dims.tp_enabled or dims.ep_enabled:
        return False
    if parallelized is not None and parallelized.fsdp is not None:
        return False
    return engine is None or not engine.has_rank_state


def model_state(strategy: HybridParallelStrategy) -> dict[str, Any]:
    model = strategy.model
    assert model is not None
    return model.state_dict() if whole_on_every_rank(strategy) else get_model_state_dict(model)


def optimizer_state(strategy: HybridParallelStrategy, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    assert strategy.model is not None
    optimizer = unwrap_optimizer(optimizer)
    return optimizer.state_dict() if whole_on_every_rank(strategy) else sharded.optimizer_state(strategy.model, optimizer)


def save_checkpoint(strategy: HybridParallelStrategy, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
    if storage_options is not None:
        raise TypeError("HybridParallelStrategy.save_checkpoint does not take storage_options.")
    io = _chunked_io(strategy, filepath)
    if io is None and whole_on_every_rank(strategy):  # as DDPStrategy writes it: one file, by rank zero
        if strategy.is_global_zero:
            path = Path(str(filepath))
            if path.is_dir():  # a sharded checkpoint of the same name, written earlier
                shutil.rmtree(path)
            strategy.checkpoint_io.save_checkpoint(checkpoint, filepath)
        strategy.barrier("checkpoint-saved")
        return
    checkpoint = dict(checkpoint)  # the caller's dict (what on_save_checkpoint hooks saw) stays whole
    model_state, optimizer_states = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
    model, optimizers = strategy.model, [unwrap_optimizer(o) for o in strategy.optimizers]
    assert model is not None  # a whole run's optimizer states are by index (Lightning's form): by name for DCP
    optimizer_states = [optimizer_state_by_name(model, o, s) for o, s in zip(optimizers, optimizer_states)]
    engine = strategy.data_parallel
    saved = engine_state(engine)  # per rank (error-feedback residuals, DiLoCo's round): one key per rank
    rank_state = saved["state"] if saved is not None else None
    if saved is not None:
        checkpoint[ENGINE_STATE_KEY] = saved["description"]
    key = rank_key(strategy)
    lowest_rank = engine is not None and engine.replicas_differ  # one consistent replica, not a mix of them
    if io is not None:
        extra = {"step": checkpoint.get("global_step", 0), "epoch": checkpoint.get("epoch", 0)}
        io.save_sharded(
            filepath,
            (model_state, optimizer_states, checkpoint, rank_state),
            extra,
            lambda staged, writer, group: save_sharded(
                *staged, key, storage_writer=writer, process_group=group, lowest_rank=lowest_rank
            ),
        )
        return
    path = Path(strategy.broadcast(str(filepath)))
    if strategy.is_global_zero:
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
    strategy.barrier("checkpoint-dir")
    save_sharded(model_state, optimizer_states, checkpoint, rank_state, key, checkpoint_id=path, lowest_rank=lowest_rank)
    strategy.barrier("checkpoint-saved")
    _say_how_to_read_once(strategy, path)


def _say_how_to_read_once(strategy: HybridParallelStrategy, path: Path) -> None:
    """The first sharded directory a strategy writes comes with one line on reading it: Lightning's
    ``load_from_checkpoint`` opens the path as a file before any hook of ours runs, so it cannot say this itself."""
    if strategy.told_how_to_read:
        return
    strategy.told_how_to_read = True
    rank_zero_info(
        f"HybridParallelStrategy: {path} is a sharded checkpoint directory (torch.distributed.checkpoint): Trainer.fit"
        f"(ckpt_path=...) resumes from it in any layout; LightningModule.load_from_checkpoint and torch.load read one"
        f" file, which `lightning-ciuic checkpoint export {path} {path.with_suffix('')}-whole.ckpt` writes."
    )


def load_checkpoint(strategy: HybridParallelStrategy, checkpoint_path: Any) -> dict[str, Any]:
    strategy.batch_check.arm()  # the restored loaders' first batch is compared again
    path = strategy.broadcast(str(checkpoint_path))
    with reported_once(f"restoring checkpoint {path}"):  # a failed restore is said once, by the lowest failing rank
        return _load_checkpoint(strategy, path)


def _load_checkpoint(strategy: HybridParallelStrategy, path: str) -> dict[str, Any]:
    model = strategy.model
    assert model is not None
    optimizers = [unwrap_optimizer(o) for o in strategy.optimizers]
    key = rank_key(strategy)
    strict = strategy.lightning_module.strict_loading
    io = _chunked_io(strategy, path)
    if io is not None:
        meta, rank_state = io.load_with_fallback(
            path, lambda name: load_sharded(model, optimizers, key, storage_reader=io.reader(name), strict=strict)
        )
    elif Path(path).is_file():  # Lightning's single-file checkpoint (ours of a whole run, or DDPStrategy's)
        whole = strategy.checkpoint_io.load_checkpoint(path)
        if not isinstance(whole, dict) or "state_dict" not in whole:
            raise ValueError(
                f"{path} is not a Lightning checkpoint (no 'state_dict' in it): pass a file written by"
                " trainer.save_checkpoint or ModelCheckpoint, or a HybridParallelStrategy checkpoint directory."
            )
        meta, rank_state = load_whole(model, optimizers, whole, strict), None
    else:
        meta, rank_state = load_sharded(model, optimizers, key, checkpoint_id=Path(path), strict=strict)
    description = meta.pop(ENGINE_STATE_KEY, None)
    engine = strategy.data_parallel
    if engine is not None and engine.has_rank_state:
        found = rank_state is not None and description is not None
        restore_engine_state(engine, {"state": rank_state, "description": description} if found else None)
        if not found:  # residuals at zero; DiLoCo starts a new round from the loaded model
            rank_zero_info("checkpoint has no data-parallel engine state for this rank and layout: it starts afresh.")
    return meta


def remove_checkpoint(strategy: HybridParallelStrategy, filepath: Any) -> None:
    if not strategy.is_global_zero:
        return
    io = _chunked_io(strategy, filepath)
    if io is not None:
        io.remove_checkpoint(filepath)
    elif Path(str(filepath)).is_dir():
        shutil.rmtree(filepath, ignore_errors=True)
    else:
        strategy.checkpoint_io.remove_checkpoint(filepath)
