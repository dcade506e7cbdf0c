"""The share of a step a pipeline schedule leaves its ranks idle, from the schedule's own order of actions.

Contract: :func:`schedule_bubble(schedule, pp_size, num_microbatches, stages_per_rank)` takes the order of compute
actions the schedule runs on each rank (the multi-stage schedules' ``pipeline_order``, which their runtime executes:
:func:`~lightning_ciuic.compat.pipeline_schedule_order`; GPipe's and 1F1B's loops written out as torch runs them: all
forwards then all backwards, and ``min(m, stages - s)`` forwards before stage ``s``'s first backward then one
backward and one forward in turn) and plays it on a clock: of a rank's
``k`` stages each takes ``1 / k`` for a micro-batch's forward, twice that for its full backward, ``1 / k`` each for
an input and a weight backward (zero-bubble split), and a DualPipeV forward-backward pair the sum of its two parts
(the pair overlaps communication, not compute). An action starts once its rank is free and what it needs has ended:
a forward the previous stage's forward of its micro-batch, a backward the next stage's (the last stage its own
forward), a weight backward its input backward. Returns ``1 - busy / step``: each rank computes
``3 * num_microbatches`` units, the step ends with the last action. Stages of equal speed and no time for the
point-to-point sends (the step estimate adds communication apart). GPipe and 1F1B give their closed form
``(p - 1) / (m + p - 1)``, interleaved 1F1B with ``v`` stages per rank ``(p - 1) / (v m + p - 1)``; the zero-bubble
schedules and DualPipeV less.

:func:`paired_fraction(schedule, pp_size, num_microbatches, rank)`: of a rank's forwards and backwards, the share
DualPipeV runs in forward-backward pairs (:mod:`~lightning_ciuic.parallel.paired_overlap` overlaps their all-to-alls
with the other micro-batch's compute): at pp 16 and 32 micro-batches 17 to 31 of a rank's 64 forwards are paired
(0.27-0.48), at 120 micro-batches 193 to 207 of 240 (0.80-0.86).

No Lightning imports.
"""

from __future__ import annotations

import functools
from typing import Optional

from lightning_ciuic import compat
from lightning_ciuic.parallel.pipeline import SCHEDULES, forwards_in_flight, resolve_stages_per_rank
from lightning_ciuic.parallel.weight_backlog import limit_deferred_weight_backwards

_COST = {"F": 1, "B": 2, "I": 1, "W": 1}  # in forwards of one stage


@functools.lru_cache(maxsize=64)
def schedule_bubble(
    schedule: str, pp_size: int, num_microbatches: int, stages_per_rank: int | None = None,
    max_deferred_weight_backwards: int | None = None,
) -> float:
    """The idle fraction of a step of ``schedule`` on ``pp_size`` ranks (see the module docstring), its weight
    backwards limited as the runner limits them (:mod:`~lightning_ciuic.parallel.weight_backlog`)."""
    if pp_size == 1:
        return 0.0
    local = resolve_stages_per_rank(schedule, stages_per_rank)
    if SCHEDULES[schedule].placement == "single":
        order = [_single_stage_order(schedule, stage, pp_size, num_microbatches) for stage in range(pp_size)]
    else:
        limited = functools.partial(limit_deferred_weight_backwards, limit=max_deferred_weight_backwards)
        order = compat.pipeline_schedule_order(SCHEDULES[schedule].cls_name, pp_size, num_microbatches, local, limited)
    last_stage = pp_size * local - 1
    ended: dict[tuple[str, int, int], float] = {}  # ("F" | "B" (either backward: the input's gradient) | "W", ...)

    def needs(kind: str, stage: int, microbatch: int) -> Optional[tuple[str, int, int]]:
        if kind == "F":
            return ("F", stage - 1, microbatch) if stage > 0 else None
        if kind == "W":
            return ("B", stage, microbatch)
        return ("B", stage + 1, microbatch) if stage < last_stage else ("F", stage, microbatch)

    clock, next_action = [0.0] * pp_size, [0] * pp_size
    while any(n < len(actions) for n, actions in zip(next_action, order)):
        moved = False
        for rank, actions in enumerate(order):
            while next_action[rank] < len(actions):
                parts = actions[next_action[rank]]
                wanted = [w for w in (needs(*part) for part in parts) if w is not None]
                if any(w not in ended for w in wanted):
                    break
                start = max([clock[rank], *(ended[w] for w in wanted)])
                clock[rank] = start + sum(_COST[kind] for kind, _, _ in parts) / local
                for kind, stage, microbatch in parts:
                    ended["B" if kind == "I" else kind, stage, microbatch] = clock[rank]
                next_action[rank] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline schedule {schedule!r} on {pp_size} ranks stalls: an action waits for one never run")
    return 1 - 3 * num_microbatches / max(clock)


def paired_fraction(schedule: str, pp_size: int, num_microbatches: int, rank: int, stages_per_rank: int | None = None) -> float:
    """Of pipeline rank ``rank``'s micro-batch forwards and backwards, the fraction that runs inside DualPipeV's
    forward-backward pairs (``OVERLAP_F_B``: each part counted once, a pair two of them); 0 for the other schedules."""
    if pp_size == 1 or SCHEDULES[schedule].placement == "single":
        return 0.0
    return _paired_fractions(schedule, pp_size, num_microbatches, resolve_stages_per_rank(schedule, stages_per_rank))[rank]


@functools.lru_cache(maxsize=64)
def _paired_fractions(schedule: str, pp_size: int, num_microbatches: int, local: int) -> tuple[float, ...]:
    """:func:`paired_fraction` of every rank, from one build of the schedule's order."""
    fractions = []
    for actions in compat.pipeline_schedule_order(SCHEDULES[schedule].cls_name, pp_size, num_microbatches, local):
        passes = [part for parts in actions for part in parts if part[0] in ("F", "B", "I")]
        paired = sum(len(parts) for parts in actions if len(parts) == 2)
        fractions.append(paired / len(passes) if passes else 0.0)
    return tuple(fractions)


def _single_stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[tuple[str, int, int]]]:
    """GPipe's or 1F1B's actions on ``stage``, as torch's ``_step_microbatches`` loops run them."""
    warmup = forwards_in_flight(schedule, stage, stages, microbatches)
    order = [("F", m) for m in range(warmup)]
    for m in range(microbatches - warmup):
        order += [("B", m), ("F", warmup + m)]
    order += [("B", m) for m in range(microbatches - warmup, microbatches)]
    return [((kind, stage, m),) for kind, m in order]
