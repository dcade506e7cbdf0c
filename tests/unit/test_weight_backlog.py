"""parallel/weight_backlog.py: the split-backward schedules' weight backwards limited, on torch's own orders."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from lightning_ciuic.parallel.pipeline import SCHEDULES, SPLIT_BACKWARD_SCHEDULES
from lightning_ciuic.parallel.pipeline_module import PipelineConfig
from lightning_ciuic.parallel.schedule_bubble import schedule_bubble
from lightning_ciuic.parallel.weight_backlog import limit_deferred_weight_backwards

SPLIT = list(SPLIT_BACKWARD_SCHEDULES)


def _kind(action) -> str:
    return "pair" if action.sub_actions else action.computation_type.value


def _most_pending(actions: list) -> int:
    """The most weight backwards pending when a computation other than a weight backward starts."""
    pending = most = 0
    for action in filter(None, actions):
        if _kind(action) == "W":
            pending -= 1
            continue
        most = max(most, pending)
        pending += _kind(action) == "I"
    return most


def _expanded(limited: list, torch_order: list) -> list:
    """A limited order with each full backward it made of an input and a weight backward (torch's order has an input
    backward of its stage and micro-batch) as those two again."""
    split = {(a.stage_index, a.microbatch_index) for a in filter(None, torch_order) if _kind(a) == "I"}
    expanded = []
    for action in limited:
        if action is not None and _kind(action) == "B" and (action.stage_index, action.microbatch_index) in split:
            expanded += [action._replace(computation_type=schedules.BACKWARD_INPUT),
                         action._replace(computation_type=schedules.BACKWARD_WEIGHT)]
        else:
            expanded.append(action)
    return expanded


@pytest.mark.parametrize("schedule", SPLIT)
@pytest.mark.parametrize("pp,microbatches", [(2, 4), (4, 8), (4, 12)])
def test_only_weight_backwards_move_earlier_and_the_limit_holds(schedule: str, pp: int, microbatches: int) -> None:
    """Every rank runs the same computations; all but the weight backwards in torch's order; each weight backward after
    its input backward and no later than torch runs it; never more than the limit pending; a limit of 0 runs whole
    backwards (no weight pass); ``None`` changes nothing."""
    torch_order = get_schedule_ops(getattr(schedules, SCHEDULES[schedule].cls_name), pp, microbatches, 2)
    assert max(_most_pending(actions) for actions in torch_order) > 0  # torch defers some: a limit of 0 moves them
    for limit in (0, 1, 2):
        for actions in torch_order:
            limited = limit_deferred_weight_backwards(actions, limit)
            expanded = _expanded(limited, actions)
            assert sorted(map(str, filter(None, expanded))) == sorted(map(str, filter(None, actions)))
            others = [a for a in actions if a is None or _kind(a) != "W"]
            assert [a for a in expanded if a is None or _kind(a) != "W"] == others
            assert _most_pending(expanded) <= limit
            for action in filter(None, expanded):
                if _kind(action) == "W":
                    position = expanded.index(action)
                    input_pass = next(a for a in expanded if a is not None and _kind(a) == "I"
                                      and (a.stage_index, a.microbatch_index) == (action.stage_index, action.microbatch_index))
                    assert expanded.index(input_pass) < position
                    before = sum(1 for a in expanded[:position] if a is None or _kind(a) != "W")
                    assert before <= sum(1 for a in actions[:actions.index(action)] if a is None or _kind(a) != "W")
            if limit == 0:  # every weight backward right after its input backward: full backwards only
                assert not any(_kind(a) in ("I", "W") for a in filter(None, limited))
        assert [limit_deferred_weight_backwards(actions, None) for actions in torch_order] == torch_order


def test_the_limited_orders_never_stall_and_cost_bubble():
    """The bubble model plays every limited order to its end (an action that waits for one never run raises); the
    figures the module docstring gives: DualPipeV at pp 16 x 32 micro-batches, 13.5% with torch's order, 16.2% at a
    limit of 1, 27.8% at 0."""
    for schedule in SPLIT:
        for limit in (None, 0, 1, 3):
            assert 0 < schedule_bubble(schedule, 4, 8, 2, limit) < 0.5
    assert round(schedule_bubble("dualpipev", 16, 32, 2), 3) == 0.135
    assert round(schedule_bubble("dualpipev", 16, 32, 2, 1), 3) == 0.162
    assert round(schedule_bubble("dualpipev", 16, 32, 2, 0), 3) == 0.278  # whole backwards: gradients sent later


def test_a_limit_on_a_schedule_that_defers_nothing_is_refused():
    with pytest.raises(ValueError, match=r"max_deferred_weight_backwards=1 bounds .* pipeline_schedule='1f1b' runs whole"
                                         r" backwards and defers none; use one of \['dualpipev'"):
        PipelineConfig("1f1b", max_deferred_weight_backwards=1)
    with pytest.raises(ValueError, match=r"max_deferred_weight_backwards must be an integer >= 0 or None, got -1"):
        PipelineConfig("dualpipev", max_deferred_weight_backwards=-1)
    assert PipelineConfig("zbv_zero_bubble", max_deferred_weight_backwards=0).max_deferred_weight_backwards == 0
