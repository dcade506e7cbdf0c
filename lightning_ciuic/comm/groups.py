"""Side process groups: a group beside training's, for a component's own collectives.

:func:`side_group` makes a group (collective over every process), after which the process leaves its groups at
interpreter exit without gloo aborting it (:func:`~lightning_ciuic.parallel.shutdown.leave_at_exit`; under a strategy
that does not, Lightning's ``ddp_spawn``, a group still held at exit could make a finished rank abort).
:func:`side_copy` makes a second group with the ranks of ``group`` (collective over every process: each builds every
such group, in the same order), for collectives that run on another thread while training uses ``group``: gloo and
NCCL need every rank to issue a group's collectives in one order, which two threads sharing a group cannot promise.
:func:`close_group` closes one together: every rank waits at a barrier first (a rank that leaves while a peer's gloo
connection is open makes that peer abort), unless a peer may be gone after a failure, where a barrier could wait for
it forever. No Lightning imports.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from lightning_ciuic.parallel.shutdown import leave_at_exit


def close_group(group: Optional[dist.ProcessGroup], together: bool = True) -> None:
    if group is None or not dist.is_initialized():
        return
    if together:
        dist.barrier(group=group)
    dist.destroy_process_group(group)


def side_group(ranks: Optional[list[int]] = None, backend: str = "gloo") -> dist.ProcessGroup:
    """A new group of ``ranks`` (all when ``None``); every process calls it. The process leaves its groups at exit."""
    group = dist.new_group(ranks, backend=backend)
    leave_at_exit()
    return group


def side_copy(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new group of ``group``'s ranks, same backend; every process calls it (all such groups are made together)."""
    mine = dist.get_process_group_ranks(group)
    everyone: list[Optional[list[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    made = None
    for ranks in sorted({tuple(r) for r in everyone if r is not None}):
        new = side_group(list(ranks), backend=dist.get_backend(group))
        if list(ranks) == mine:
            made = new
    assert made is not None
    return made
