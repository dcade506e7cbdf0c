"""Fault injection for tests, demos and benchmarks: small callbacks that make one rank misbehave on purpose.

Contract: each injector acts only on the ranks it names (global ranks) and is a no-op elsewhere, so the same
callback list is passed to every rank.

* :class:`SlowRank`: a straggler. Sleeps inside the rank's compute (between forward and backward, where
  :mod:`lightning_ciuic.telemetry` counts compute time), either ``seconds_per_sample`` times the batch's
  samples or ``slowdown - 1`` times the forward pass just measured (backward costs about twice the forward,
  so ``slowdown=2`` sleeps three forwards' worth, making forward + backward about twice as long).
* :class:`SlowGradientSync`: a slow collective. On ``HybridParallelStrategy`` each gradient bucket's reduction
  waits ``seconds`` longer on the named ranks (after backward, where the synchronizer waits for it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from datetime import timedelta

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override


class SlowRank(Callback):
    """Make ``ranks`` slower: a fixed delay per sample, or a slowdown factor of their own compute."""

    def __init__(self, ranks: Iterable[int] = (1,), seconds_per_sample: float = 0.0, slowdown: float = 1.0) -> None:
        if seconds_per_sample < 0 or slowdown < 1:
            raise ValueError(f"need seconds_per_sample >= 0 and slowdown >= 1, got {seconds_per_sample}, {slowdown}.")
        self.ranks, self.seconds_per_sample, self.slowdown = set(ranks), seconds_per_sample, slowdown
        self._start, self._samples = 0.0, 0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start, self._samples = time.perf_counter(), extract_batch_size(batch)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if trainer.global_rank not in self.ranks:
            return
        forward = time.perf_counter() - self._start
        time.sleep(self.seconds_per_sample * self._samples + (self.slowdown - 1) * 3 * forward)


class _DelayedReduction:
    def __init__(self, pending: Any, seconds: float) -> None:
        self.pending, self.seconds = pending, seconds

    def wait(self, timeout: timedelta) -> int:
        time.sleep(self.seconds)
        return self.pending.wait(timeout)

    def done(self) -> bool:
        return False  # the delay happens in wait()


class SlowGradientSync(Callback):
    """Every gradient bucket's reduction on ``ranks`` takes ``seconds`` longer (HybridParallelStrategy)."""

    def __init__(self, ranks: Iterable[int] = (0,), seconds: float = 0.05) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}.")
        self.ranks, self.seconds = set(ranks), seconds

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        sync = getattr(trainer.strategy, "grad_sync", None)
        if sync is None:
            raise TypeError(f"SlowGradientSync needs HybridParallelStrategy's synchronizer, not {type(trainer.strategy).__name__}.")
        if trainer.global_rank in self.ranks:
            reducer, seconds = sync.reducer, self.seconds
            sync.reducer = lambda *args: _DelayedReduction(reducer(*args), seconds)
