"""parallel.pipeline_sends: a multi-stage schedule's sends waited for once they must have completed, not at the step's
end: never a wait that can deadlock, and the sends in flight bounded whatever the number of micro-batches."""

import pytest
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from lightning_ciuic import compat
from lightning_ciuic.parallel.pipeline_sends import SendRelease, release_points

MULTI_STAGE = [  # (schedule, placement, whether its sends in flight are bounded whatever the micro-batches)
    ("ScheduleInterleaved1F1B", "loop", True), ("ScheduleInterleavedZeroBubble", "loop", True),
    ("ScheduleZBVZeroBubble", "v", True), ("ScheduleDualPipeV", "v", True),
    ("ScheduleLoopedBFS", "loop", False),  # every forward first, as GPipe: nothing comes back before the backwards
]


def _order(name: str, style: str, pp: int, microbatches: int) -> tuple[dict, dict]:
    """Every rank's actions, communication included, as torch's runtime executes them (built on mock stages, read as
    the runner reads a schedule's)."""

    class Runtime:
        pipeline_order_with_comms = dict(enumerate(get_schedule_ops(getattr(schedules, name), pp, microbatches, 2, with_comms=True)))
        stage_index_to_group_rank = schedules.generate_stage_to_rank_mapping(pp, 2 * pp, style=style)

    return compat.pipeline_order_with_comms(Runtime())


def _play(order: dict, stage_rank: dict, points: dict) -> dict[int, int]:
    """Plays every rank's actions with the early waits: a computation waits for its receive's send to have run; the
    early wait of a send waits for its receiver to have posted the receive (no later action of the sender needed).
    Returns each rank's most sends in flight; raises if the ranks stall (a deadlock)."""
    def receiver(send):  # (rank, its receive action)
        kind, stage, mb = send
        to, recv = (stage + 1, "RECV_F") if kind == "SEND_F" else (stage - 1, "RECV_B")
        return stage_rank[to], (recv, to, mb)

    done = {rank: set() for rank in order}
    step, in_flight, most = {rank: 0 for rank in order}, {rank: set() for rank in order}, {rank: 0 for rank in order}
    while any(step[r] < len(order[r]) for r in order):
        moved = False
        for rank, actions in order.items():
            while step[rank] < len(actions):
                kind, stage, mb = action = actions[step[rank]]
                if kind in ("F", "B", "I"):
                    needs = ("SEND_F", stage - 1, mb) if kind == "F" else ("SEND_B", stage + 1, mb)
                    source = stage_rank.get(needs[1])
                    released = points.get(("F" if kind == "F" else "B", stage, mb), ())
                    received = ("RECV_F" if kind == "F" else "RECV_B", stage, mb) in done[rank]
                    if source not in (None, rank) and received and needs not in done[source]:
                        break
                    if any(receiver(s)[1] not in done[receiver(s)[0]] for s in released):
                        break
                    in_flight[rank] -= set(released)
                elif kind.startswith("SEND"):
                    in_flight[rank].add(action)
                done[rank].add(action)
                most[rank] = max(most[rank], len(in_flight[rank]))
                step[rank] += 1
                moved = True
        if not moved:
            raise AssertionError(f"stalled at {step}")
    return most


@pytest.mark.parametrize("name, style, bounded", MULTI_STAGE)
def test_the_early_waits_never_deadlock_and_bound_the_sends_in_flight(name, style, bounded):
    most = {}
    for microbatches in (8, 16):
        order, stage_rank = _order(name, style, 4, microbatches)
        points = {rank: release_points(order, rank, stage_rank) for rank in order}
        sends = {rank: sum(a[0].startswith("SEND") for a in order[rank]) for rank in order}
        most[microbatches] = {}
        for rank in order:
            held = _play(order, stage_rank, points[rank])[rank]
            most[microbatches][rank] = held
            assert held < sends[rank]  # torch alone holds them all to the step's end
    assert (most[8] == most[16]) == bounded, most  # bounded: twice the micro-batches, no more sends in flight



def test_a_send_waited_for_at_the_next_computation_can_deadlock_where_the_release_points_cannot():
    """The player does catch a deadlock, and release_points avoids it: rank 1 posts its receive of micro-batch 0 only
    after micro-batch 1's, so rank 0 waiting for its first send before its next forward never sends the second; the
    release points wait for both only before the backward whose gradient rank 1 sent after posting those receives."""
    order = {
        0: [("F", 0, 0), ("SEND_F", 0, 0), ("F", 0, 1), ("SEND_F", 0, 1), ("RECV_B", 0, 0), ("B", 0, 0),
            ("RECV_B", 0, 1), ("B", 0, 1)],
        1: [("RECV_F", 1, 1), ("F", 1, 1), ("RECV_F", 1, 0), ("F", 1, 0), ("B", 1, 0), ("SEND_B", 1, 0), ("B", 1, 1),
            ("SEND_B", 1, 1)],
    }
    stage_rank = {0: 0, 1: 1}
    with pytest.raises(AssertionError, match="stalled"):
        _play(order, stage_rank, {("F", 0, 1): [("SEND_F", 0, 0)]})  # waited for at the next computation
    points = release_points(order, 0, stage_rank)
    assert points == {("B", 0, 0): [("SEND_F", 0, 0), ("SEND_F", 0, 1)], ("B", 0, 1): []}
    assert _play(order, stage_rank, points)[0] == 2

class _Work:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1
        return True

    def is_completed(self):
        return self.waits > 0


def test_a_named_send_batch_is_waited_for_at_its_release_point_and_torchs_own_wait_is_then_a_no_op():
    release = SendRelease({("B", 0, 0): [("SEND_F", 0, 0)]})
    receive = _Work()
    assert release.works(False, [receive]) == [receive]  # not a named send batch: as it is
    release.sending("SEND_F", 0, 0)
    work = _Work()
    (wrapped,) = release.works(True, [work])
    release.before("F", 1, 0)
    assert work.waits == 0 and not wrapped.is_completed()
    release.before("B", 0, 0)
    assert work.waits == 1 and wrapped.is_completed()
    assert wrapped.wait() is True and work.waits == 1  # dropped: torch's wait at the step's end does not wait again
    with release.step():
        release.sending("SEND_F", 0, 0)
        release.works(True, [_Work()])
    assert release._in_flight == {}  # a step's sends forgotten after it (torch waited for them)
