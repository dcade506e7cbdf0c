"""Fault injection for tests, demos and benchmarks: small callbacks that make one rank misbehave on purpose.

Contract: each injector acts only on the ranks it names (global ranks) and is a no-op elsewhere, so the same
callback list is passed to every rank.

* :class:`SlowRank`: a straggler. Sleeps inside the rank's compute (between forward and backward, where
  :mod:`lightning_ciuic.telemetry` counts compute time), either ``seconds_per_sample`` times the batch's
  samples or ``slowdown - 1`` times the forward pass just measured (backward costs about twice the forward,
  so ``slowdown=2`` sleeps three forwards' worth, making forward + backward about twice as long).
* :class:`SlowGradientSync`: a slow collective. On ``HybridParallelStrategy`` each gradient bucket's reduction
  waits ``seconds`` longer on the named ranks (after backward, where the synchronizer waits for it).
* :class:`FailAt`: optimizer step ``step`` fails on the named ranks, once: ``"nan"`` makes the step's gradients
  NaN (the update is poisoned; training goes on), ``"raise"`` raises, ``"kill"`` sends the process SIGKILL,
  ``"hang"`` sleeps (a collective timeout on the other ranks ends it). Under TorchElastic it fires only in restart
  attempt ``attempt``, so a restarted run does not fail again. ``lose_snapshots`` first deletes the rank's
  :class:`~lightning_ciuic.callbacks.recovery.SnapshotRecovery` snapshots, as losing the node loses its memory.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterable
from typing import Any, Literal, Optional

from datetime import timedelta

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_ciuic.strategies.context import parallel_context
from lightning_ciuic.telemetry import samples_in
from lightning_ciuic.validation import check_choice, check_int


class SlowRank(Callback):
    """Make ``ranks`` slower: a fixed delay per sample, or a slowdown factor of their own compute."""

    def __init__(self, ranks: Iterable[int] = (1,), seconds_per_sample: float = 0.0, slowdown: float = 1.0) -> None:
        if seconds_per_sample < 0 or slowdown < 1:
            raise ValueError(f"need seconds_per_sample >= 0 and slowdown >= 1, got {seconds_per_sample}, {slowdown}.")
        self.ranks, self.seconds_per_sample, self.slowdown = set(ranks), seconds_per_sample, slowdown
        self._start, self._samples = 0.0, 0

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start, self._samples = time.perf_counter(), samples_in(batch)

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
        sync = getattr(parallel_context(trainer).data_parallel, "synchronizer", None)
        if sync is None:
            raise TypeError(f"SlowGradientSync needs HybridParallelStrategy's synchronizer, not {type(trainer.strategy).__name__}.")
        if trainer.global_rank in self.ranks:
            reducer, seconds = sync.reducer, self.seconds
            sync.reducer = lambda *args: _DelayedReduction(reducer(*args), seconds)


FaultKind = Literal["nan", "raise", "kill", "hang"]
_FAULTS = ("nan", "raise", "kill", "hang")


class InjectedFault(RuntimeError):
    """Raised by :class:`FailAt` with ``fault="raise"``."""


class FailAt(Callback):
    """Make optimizer step ``step`` fail on ``ranks`` (once); see the module docstring."""

    def __init__(
        self,
        step: int,
        fault: FaultKind = "raise",
        ranks: Iterable[int] = (0,),
        attempt: Optional[int] = 0,
        hang_seconds: float = 3600.0,
        lose_snapshots: bool = False,
    ) -> None:
        check_choice("fault", fault, _FAULTS)
        check_int("step", step, note="the first optimizer step is 1")
        self.step, self.fault, self.ranks, self.attempt = step, fault, set(ranks), attempt
        self.hang_seconds, self.lose_snapshots = hang_seconds, lose_snapshots
        self.fired = False

    def _due(self, trainer: Trainer) -> bool:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return (
            not self.fired
            and trainer.global_rank in self.ranks
            and trainer.global_step == self.step - 1
            and (self.attempt is None or attempt == self.attempt)
        )

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Any) -> None:
        if self.fault == "nan" and self._due(trainer) and loss.requires_grad:
            loss.register_hook(lambda grad: grad * math.nan)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not self._due(trainer):
            return
        self.fired = True
        if self.lose_snapshots:
            from lightning_ciuic.callbacks.recovery import SnapshotRecovery

            for callback in trainer.callbacks:
                if isinstance(callback, SnapshotRecovery) and callback.store is not None:
                    callback.store.clear()
        print(f"FailAt: rank {trainer.global_rank}, step {self.step}: {self.fault} at {time.time():.6f}", flush=True)
        if self.fault == "raise":
            raise InjectedFault(f"injected failure at step {self.step} on rank {trainer.global_rank}")
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "hang":
            time.sleep(self.hang_seconds)
