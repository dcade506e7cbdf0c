"""Restoring SnapshotRecovery's snapshots: after a restart, and the agreed decode a rollback also uses.

Contract:

- :func:`restore_newest`: every rank reports the snapshots it holds (its own store and, with peer copies, the
  replicas it keeps for another rank); the newest step every rank of the current run can load
  (:func:`~lightning_ciuic.checkpoint.snapshot.plan_restores`: the same layout, or another data-parallel size
  from a replica's state) is moved to the ranks that lack it (:func:`~lightning_ciuic.checkpoint.snapshot.transfer`)
  and applied to the Trainer; a step that fails its check on any rank is skipped everywhere. Returns a sentence
  saying what was restored, or ``None``.
- :func:`restore_from_checkpoint`: the newest committed checkpoint of an
  :class:`~lightning_ciuic.callbacks.async_checkpoint.AsyncCheckpointer` in the run, else ``None``.
- :func:`decode_agreed`: this rank's snapshot decoded, or ``None`` on every rank unless every rank's decodes (a
  damaged one is reported by the rank that found it).

All three are collectives over the per-step vote's control group.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_ciuic.callbacks.trainer_state import apply_lightning_checkpoint, apply_training_state
from lightning_ciuic.checkpoint.snapshot import (
    CorruptSnapshotError,
    Holding,
    MemoryStore,
    RestorePlan,
    decode_snapshot,
    plan_restores,
    transfer,
)
from lightning_ciuic.comm.vote import StepVote
from lightning_ciuic.parallel.dims import ParallelDims


def decode_agreed(vote: StepVote, blob: Union[bytes, memoryview], name: str) -> Optional[dict[str, Any]]:
    state = None
    try:
        state, _ = decode_snapshot(blob, name)
    except CorruptSnapshotError as error:  # reported by the rank that found it, which may not be rank 0
        rank = dist.get_rank() if vote.group is not None else 0
        warnings.warn(f"SnapshotRecovery (rank {rank}): {error} Trying the next candidate.")
    return state if vote.all_ok(state is not None) else None


def restore_newest(
    trainer: Trainer,
    pl_module: LightningModule,
    stores: dict[str, Optional[MemoryStore]],
    vote: StepVote,
    dims: ParallelDims,
    skip: Callback,
) -> Optional[str]:
    """``stores``: ``{"own": ..., "replica": ...}``; ``dims``: this run's layout; ``skip``: the callback whose own
    state the snapshot does not restore (the caller)."""
    rank = trainer.global_rank
    mine = [
        Holding(rank, where, step, h["world_size"], h["rank"], h["layout"], h.get("loss"))
        for where, store in stores.items() if store is not None
        for step, h in store.headers().items()
    ]
    holdings = [holding for table in vote.gather(mine) for holding in table]
    for plan in plan_restores(holdings, dims):
        moves = [(source.holder, owner) for owner, source in enumerate(plan.sources) if source.holder != owner]

        def blob_for(owner: int, plan: RestorePlan = plan) -> bytes:
            source = plan.sources[owner]
            store = stores[source.where]
            assert store is not None
            return store.get(source.step)

        received = transfer(moves, rank, blob_for, vote.group)
        mine_source = plan.sources[rank]
        blob = received[rank] if rank in received else stores[mine_source.where].get(plan.step)  # type: ignore[union-attr]
        state = decode_agreed(vote, blob, f"snapshot of rank {mine_source.rank} at step {plan.step}")
        if state is None:
            continue
        apply_training_state(trainer, pl_module, state, rewind_only=False, rank_state=not plan.resharded, skip=skip)
        origin = "a peer's copy" if any(s.where == "replica" for s in plan.sources) else "this node's memory"
        if moves and origin != "a peer's copy":
            origin = "another rank's memory"
        taken_by = f"{plan.world_size} rank" + ("s" if plan.world_size > 1 else "")
        layout_note = "" if plan.world_size == trainer.world_size else f", taken by {taken_by}"
        own = stores["own"]
        assert own is not None
        return f"the step-{plan.step} snapshot ({own.kind}, {origin}{layout_note})"
    return None


def restore_from_checkpoint(trainer: Trainer) -> Optional[str]:
    from lightning_ciuic.callbacks.async_checkpoint import AsyncCheckpointer

    for callback in trainer.callbacks:
        if isinstance(callback, AsyncCheckpointer):
            last = callback.latest_checkpoint()
            if last is not None:
                apply_lightning_checkpoint(trainer, trainer.strategy.load_checkpoint(last))
                return f"checkpoint {last}"
    return None
