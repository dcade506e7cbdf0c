"""Which snapshot to restore: the order of a rollback's candidates and the plans of a restart.

Contract: :func:`recovery_order` sorts a rank's kept snapshot steps by the recovery strategy; :func:`plan_restores`
lists, newest first, every snapshot step the current run can restore from the :class:`Holding` s every rank
reported (its own layout, or another data-parallel size from a replicated run's state). No Lightning imports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from lightning_ciuic.parallel.dims import ParallelDims


def recovery_order(losses: dict[int, Optional[float]], strategy: str) -> list[int]:
    """Steps to try, best first: ``"latest"``: newest first; ``"min_loss"``: lowest recorded loss first (a
    snapshot without a finite loss last), newest first among equal losses."""
    if strategy == "latest":
        return sorted(losses, reverse=True)

    def rank(step: int) -> tuple[float, int]:
        loss = losses[step]
        return (loss if loss is not None and math.isfinite(loss) else math.inf, -step)

    return sorted(losses, key=rank)


@dataclass(frozen=True)
class Holding:
    """A snapshot a process holds: where (its own store or its peer replicas), and whose state it is."""

    holder: int  # the process (global rank now) that has it
    where: str  # "own" or "replica"
    step: int
    world_size: int  # of the run that took it
    rank: int  # the rank whose state it is, in that run
    layout: str  # that run's ParallelDims.layout_key(rank): what the shapes of the rank's state depend on
    loss: Optional[float] = None


@dataclass(frozen=True)
class RestorePlan:
    """Where each rank of the current run gets its state from, for one snapshot step."""

    step: int
    world_size: int  # of the run that took the snapshot
    sources: tuple[Holding, ...]  # indexed by the current rank

    @property
    def resharded(self) -> bool:
        """The state comes from another layout or another rank (a data-parallel replica): rank-local state such
        as compression residuals does not apply."""
        return any(source.rank != rank or source.world_size != len(self.sources) for rank, source in enumerate(self.sources))


def plan_restores(holdings: Iterable[Holding], dims: ParallelDims) -> list[RestorePlan]:
    """Every snapshot step the current run (``dims``: its world size and layout) can restore, newest first.

    A rank restores its own state from the same world size and its own holding of its layout key
    (:meth:`ParallelDims.layout_key`: its coordinates on every axis that shapes what it holds), or, when only the
    data-parallel size changed in a replicated run without pipeline stages, the state of any rank of its key:
    data-parallel replicas with equal tensor-parallel and expert-parallel coordinates hold the same model and optimizer
    state. A sharded run's snapshot holds one rank's shards: only the same layout restores it (another layout resumes
    from a checkpoint, which DCP reshards). A holding on the rank itself is preferred to one another process must send.
    """
    world_size = dims.world_size
    keys = [dims.layout_key(rank) for rank in range(world_size)]
    by_step: dict[tuple[int, int], list[Holding]] = {}
    for holding in holdings:
        by_step.setdefault((holding.step, holding.world_size), []).append(holding)
    reshardable = not dims.pp_enabled and not dims.sharded
    plans = []
    for (step, world), found in by_step.items():
        sources = []
        for rank, key in enumerate(keys):
            if world == world_size:
                fits = [h for h in found if h.rank == rank and h.layout == key]
            elif reshardable:
                fits = [h for h in found if h.layout == key]
            else:
                fits = []
            if not fits:
                break
            sources.append(min(fits, key=lambda h: (h.holder != rank, h.where != "own", h.holder, h.rank)))
        else:
            plans.append(RestorePlan(step, world, tuple(sources)))
    return sorted(plans, key=lambda plan: (plan.step, plan.world_size == world_size), reverse=True)
