"""A bound on the weight backwards a split-backward pipeline schedule defers.

The zero-bubble schedules and DualPipeV split a stage's backward into an input pass (``I``: the gradient its
previous stage waits for) and a weight pass (``W``), and run ``W`` later, where the rank would otherwise idle. Until
its ``W`` runs, a chunk keeps its whole graph and the output gradients ``W`` starts from: more than either pass
keeps alone. torch's orders let a rank defer as many as it likes; at the end of DualPipeV's step rank ``r`` holds
``r + 1`` of them, so its peak grows with the rank (docs/plan.md: 16 chunks, 33.6 GiB over the steady state on the
last of 16 ranks at DeepSeek-V3's shapes).

Contract: :func:`limit_deferred_weight_backwards(actions, limit)` takes one rank's order of compute actions
(torch's ``_Action`` or ``None``, as a schedule's ``pipeline_order`` holds them) and returns it with weight backwards
moved earlier, so that when any other computation starts at most ``limit`` of them are pending (run but for their
weight backward): each moved to right after the input backward that would leave more (the oldest first). Only weight
backwards move, and only earlier, after their own input backward: a weight backward needs nothing but its input
backward, and sends and receives nothing, so the order of every rank's communication is unchanged and the schedule
can stall no more than torch's. The step computes the same gradients;
it idles where the moved passes no longer fill the bubble
(:func:`~lightning_ciuic.parallel.schedule_bubble.schedule_bubble` plays the limited order: DualPipeV at pp 16 x 32
micro-batches, 13.5% with torch's order, 16.2% at a limit of 1). A limit of 0 defers none: each input backward and
its weight backward run as one full backward, the schedule's split undone: nothing pending, but the input's gradient
sent after the whole backward (27.8% at pp 16 x 32). ``limit=None`` returns the order as it is.
:func:`limit_schedule(schedule, limit)` does it to every rank's order of a built schedule (its communication lowered
again: :func:`~lightning_ciuic.compat.reorder_pipeline`).

No Lightning imports.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

from lightning_ciuic import compat


def _kind(action: Any) -> Optional[str]:
    return None if action is None or action.sub_actions else action.computation_type.value


def limit_deferred_weight_backwards(actions: list[Any], limit: Optional[int]) -> list[Any]:
    """``actions`` (one rank's order) with at most ``limit`` weight backwards pending when another computation starts."""
    if limit is None:
        return list(actions)
    weight_pass = {(a.stage_index, a.microbatch_index): a for a in actions if _kind(a) == "W"}
    pending: list[Any] = []  # weight backwards whose input backward has run, oldest first
    limited: list[Any] = []
    for action in actions:
        if _kind(action) == "W":
            if action in pending:  # not run early: runs where the schedule put it
                pending.remove(action)
                limited.append(action)
            continue
        limited.append(action)
        if _kind(action) == "I" and (action.stage_index, action.microbatch_index) in weight_pass:
            pending.append(weight_pass[action.stage_index, action.microbatch_index])
            while len(pending) > limit:
                limited.append(pending.pop(0))
    return _merged(limited) if limit == 0 else limited


def _merged(actions: list[Any]) -> list[Any]:
    """Each input backward followed at once by its own weight backward as one full backward (the same computation,
    one pass through the chunk's graph instead of two, its gradient sent after both)."""
    merged: list[Any] = []
    for action in actions:
        last = merged[-1] if merged else None
        if _kind(action) == "W" and _kind(last) == "I" and (last.stage_index, last.microbatch_index) == (
            action.stage_index, action.microbatch_index
        ):
            merged[-1] = compat.full_backward_of(last)
        else:
            merged.append(action)
    return merged


def limit_schedule(schedule: Any, limit: Optional[int]) -> None:
    """Every rank's order of ``schedule`` (torch's multi-stage runtime) limited as above; ``None`` leaves it as it is."""
    if limit is not None:
        compat.reorder_pipeline(schedule, partial(limit_deferred_weight_backwards, limit=limit))
