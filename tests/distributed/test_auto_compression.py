"""``communication_compression="auto"``'s trial schedule on a real gloo group: when it starts timing and when
it decides."""

import torch.distributed as dist

from lightning_ciuic.comm.auto import CANDIDATES, AutoCompression
from lightning_ciuic.comm.compression import GradientCompression
from tests.helpers import run_workers

TRIAL, SETTLE, RECHECK = 2, 3, 100


def _decision_steps(auto: AutoCompression, first: int) -> tuple[int, set[str]]:
    """Call ``on_step`` from optimizer step ``first`` on; the step that returns a decision, and the modes
    tried before it."""
    tried = set()
    for step in range(first, first + 50):
        tried.add(auto.compression.mode)
        if auto.on_step(dist.group.WORLD, step, gradient_numel=4096, buckets=2) is not None:
            return step, tried
    raise AssertionError("no decision within 50 steps")


def _first_decision_waits_for_the_settle_steps_and_a_recheck_does_not(rank, world):
    compression = GradientCompression("auto")
    try:
        auto = AutoCompression(compression, recheck_steps=RECHECK, trial_steps=TRIAL, settle_steps=SETTLE)
        step, tried = _decision_steps(auto, 0)
        # steps 0..SETTLE-1 run untimed in the mode predicted fastest; then TRIAL timed steps per candidate
        assert step == SETTLE + len(CANDIDATES) * TRIAL, step
        assert tried == set(CANDIDATES)
        assert all(len(times) == TRIAL for times in auto._times.values())
        step, _ = _decision_steps(auto, RECHECK)
        assert step == RECHECK + len(CANDIDATES) * TRIAL, step  # the process has settled: no settle steps again
        assert len(auto.history) == 2 and auto.history[-1].mode == compression.mode
    finally:
        compression.close()


def test_first_decision_waits_for_the_settle_steps_and_a_recheck_does_not():
    run_workers(_first_decision_waits_for_the_settle_steps_and_a_recheck_does_not, 2)
