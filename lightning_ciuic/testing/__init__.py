"""For tests, demos and benchmarks only, never a production run: callbacks that make a rank misbehave on purpose
(:mod:`.faults`: a straggler, a slow collective, a failing step) to check that the pack notices and recovers, and
a free port for a test's rendezvous (:mod:`.ports`)."""

from lightning_ciuic.testing.faults import FailAt, SlowGradientSync, SlowRank
from lightning_ciuic.testing.ports import free_port

__all__ = ["FailAt", "SlowGradientSync", "SlowRank", "free_port"]
