"""A forward-backward pair's two sides take turns at their waits, one at a time, in the same order every run
(parallel/paired_overlap.py); DualPipeV's pairs trained under it: tests/integration/test_expert_parallel.py."""

import threading

import pytest

from lightning_ciuic.parallel import paired_overlap


def _side(name: str, exchanges: int, log: list, fail_at: int = -1):
    """``exchanges`` times: compute (logged), issue an exchange, wait for it; then compute once more."""

    def run() -> None:
        assert paired_overlap.in_pair()
        for i in range(exchanges):
            log.append((name, i, threading.current_thread().name))
            if i == fail_at:
                raise RuntimeError(f"{name} failed at {i}")
            paired_overlap.issued()
            paired_overlap.before_wait()
        log.append((name, "end", threading.current_thread().name))

    return run


def test_the_sides_alternate_at_their_waits_and_the_longer_one_runs_on_alone():
    log: list = []
    paired_overlap.run_pair(_side("F", 2, log), _side("B", 4, log))
    assert [entry[:2] for entry in log] == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", "end"), ("B", 2), ("B", 3), ("B", "end"),
    ]
    main = threading.current_thread().name
    assert {entry[2] for entry in log if entry[0] == "F"} == {main}
    assert {entry[2] for entry in log if entry[0] == "B"} == {"paired backward"}
    assert not paired_overlap.in_pair()


def test_a_wait_without_an_exchange_issued_in_this_turn_keeps_the_turn():
    log: list = []

    def forward() -> None:
        log.append("F issues two")
        paired_overlap.issued()
        paired_overlap.issued()
        paired_overlap.before_wait()  # the first wait hands over
        log.append("F waits the second")
        paired_overlap.before_wait()  # nothing issued since the turn came back: no hand-over
        log.append("F end")

    def backward() -> None:
        log.append("B runs")

    paired_overlap.run_pair(forward, backward)
    assert log == ["F issues two", "B runs", "F waits the second", "F end"]


def test_an_error_on_one_side_is_raised_once_both_have_stopped():
    log: list = []
    with pytest.raises(RuntimeError, match="B failed at 1"):
        paired_overlap.run_pair(_side("F", 3, log), _side("B", 3, log, fail_at=1))
    assert [entry[:2] for entry in log] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("F", "end")]


def test_outside_a_pair_waits_hand_nothing_over():
    assert not paired_overlap.in_pair()
    turns = paired_overlap.PAIR_STATS["turns"]
    paired_overlap.issued()
    paired_overlap.before_wait()
    assert paired_overlap.PAIR_STATS["turns"] == turns
