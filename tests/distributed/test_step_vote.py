"""StepVote: every registered component's values summed over the ranks in one exchange per step."""

import pytest

from lightning_ciuic.comm.vote import StepVote
from tests.helpers import run_workers


def _one_exchange_per_key_for_every_component(rank, world):
    vote = StepVote()
    asked = []

    def flags(step):
        asked.append(step)
        return (rank == 1, step)  # raised on rank 1 only; a per-rank value

    vote.register("flags", 2, flags)
    vote.register("loss", 2, lambda step: (0.5 * (rank + 1), 1.0))
    assert vote.group is not None and vote.world_size == world
    for step in range(3):
        raised, summed = vote.result("flags", ("epoch0", step), step)
        loss_sum, reporting = vote.result("loss", ("epoch0", step), step)  # same key: read from the same exchange
        assert (raised, summed) == (1.0, world * step)
        assert loss_sum / reporting == pytest.approx(0.25 * (world + 1))
    assert vote.rounds == 3 and asked == [0, 1, 2]
    assert vote.gather(rank) == list(range(world))
    assert vote.all_ok(True) and not vote.all_ok(rank == 0)
    vote.release("flags")
    assert vote.group is not None  # still registered: "loss"
    vote.release("loss")
    assert vote.group is None


def test_one_exchange_per_step_for_every_registered_component():
    run_workers(_one_exchange_per_key_for_every_component, 2)


def test_errors_name_what_was_given():
    vote = StepVote()
    vote.register("a", 1, lambda: (1.0,))
    with pytest.raises(ValueError, match=r"'a' is already registered; registered: \['a'\]"):
        vote.register("a", 1, lambda: (1.0,))
    with pytest.raises(ValueError, match="'b' must vote at least one value, got width=0"):
        vote.register("b", 0, lambda: ())
    with pytest.raises(KeyError, match=r"'c' is not registered; registered: \['a'\]"):
        vote.result("c", 0)
    vote.register("d", 2, lambda: (1.0,))
    with pytest.raises(ValueError, match="'d' registered 2 values but its provider returned 1"):
        vote.result("a", 1)
