"""The advisor's rules: turns a run's measurements into concrete changes, each with a predicted speed-up.

Contract: :func:`advise` takes a :class:`RunProfile` (what :class:`~lightning_ciuic.callbacks.monitor.CommunicationMonitor`
measured, also stored as ``monitor.json`` so ``lightning-ciuic advise RUN_DIR`` gives the same advice offline)
and returns :class:`Advice` items, largest predicted speed-up first, only for changes predicted to gain at
least ``min_speedup`` (10%): a healthy run gets no advice. Rules, each on per-rank means over the run:

* **gradient compression** (data parallel, uncompressed or 16-bit): each dense mode's synchronization work
  (:func:`~lightning_ciuic.comm.auto.predicted_sync_seconds`: link latency and bandwidth measured at start, codec
  speed of this machine) minus what the run shows backward can absorb (see :func:`compression_speedups`) is
  its predicted exposed time. Advises ``communication_compression: <mode>``.
* **straggler**: a data-parallel replica whose compute per step is ``1 + straggler_threshold`` times the median
  of the other replicas or more (its slowest tensor-parallel rank counts); balanced
  shares would make every rank finish in ``dp / sum(1 / compute_r)``. Advises ``DynamicDataBalancer``.
* **data loading**: waiting for batches above 10% of the step; advises more DataLoader workers (predicted:
  the wait removed).
* **pipeline bubble** (pipeline parallel): measured idle fraction above 20%; advises doubling
  ``num_microbatches`` (predicted from the schedule's ``(p-1)/(m+p-1)``).

No Lightning imports.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from lightning_ciuic.advice.profile import RunProfile
from lightning_ciuic.comm.auto import CANDIDATES, predicted_sync_seconds


@dataclass(frozen=True)
class Advice:
    summary: str  # one line a person reads first
    argument: str  # the exact Trainer / YAML change
    predicted_speedup: float
    rule: str

    def __str__(self) -> str:
        return f"{self.summary}\n    change: {self.argument}  (predicted {self.predicted_speedup:.2f}x step throughput)"


def advise(profile: RunProfile, min_speedup: float = 1.10, straggler_threshold: float = 0.15) -> list[Advice]:
    found = [
        _compression(profile),
        _straggler(profile, straggler_threshold),
        _data_loading(profile),
        _bubble(profile),
    ]
    return sorted((a for a in found if a is not None and a.predicted_speedup >= min_speedup), key=lambda a: -a.predicted_speedup)


def compression_speedups(profile: RunProfile) -> dict[str, float]:
    """Predicted step-throughput ratio of each dense compression mode against the measured run.

    ``U(mode)`` is the time to synchronize one step's gradient: measured through the real reducer while the
    machine computes, at the start of training, when available (``sync_s``); else predicted from latency, wire
    bytes over the measured bandwidth and this machine's codec time (:func:`predicted_sync_seconds`). The run
    shows how much of the current mode's synchronization backward hid: ``U(current) - exposed``. A mode's
    exposed time is what its ``U`` leaves after that same hidden amount; if the run was slower than ``U``
    predicts, every ``U`` is scaled up by the same factor."""
    if profile.dp < 2 or not profile.bandwidth_bytes_per_s or not profile.gradient_numel:
        return {}
    step, exposed = profile.mean("step"), profile.mean("dp_exposed")
    if step <= 0:
        return {}

    def work(mode: str) -> float:
        if mode in profile.sync_s:
            return profile.sync_s[mode]
        return predicted_sync_seconds(
            mode, profile.gradient_numel, profile.buckets, profile.dp, profile.latency_s or 0.0,
            profile.bandwidth_bytes_per_s, profile.codec_s_per_value.get(mode, 0.0),
        )

    current = work(profile.compression)
    scale = max(1.0, exposed / current) if current > 0 else 1.0
    absorbed = max(0.0, current * scale - exposed)
    return {
        mode: step / max(step - exposed + max(0.0, work(mode) * scale - absorbed), 1e-9) for mode in CANDIDATES
    }


def _compression(profile: RunProfile) -> Optional[Advice]:
    if profile.compression not in ("none", "fp16", "bf16"):
        return None
    speedups = compression_speedups(profile)
    if not speedups:
        return None
    mode = max(speedups, key=speedups.get)
    if mode == profile.compression:
        return None
    step, exposed, comm = profile.mean("step"), profile.mean("dp_exposed"), profile.mean("dp_comm")
    algbw = profile.mean("dp_payload") / comm / 1e9
    return Advice(
        f"gradient sync is {exposed / step:.0%} of the step (exposed; {comm * 1e3:.0f} ms in all) at {algbw:.2f} GB/s:"
        f" communication_compression={mode!r} is predicted {speedups[mode]:.2f}x faster",
        f"strategy.communication_compression: {mode}   (Trainer(strategy=HybridParallelStrategy(communication_compression={mode!r})))",
        speedups[mode],
        "compression",
    )


def _straggler(profile: RunProfile, threshold: float) -> Optional[Advice]:
    if profile.dp < 2 or not profile.ranks:
        return None
    per_dp: dict[int, float] = {}
    for rank, values in enumerate(profile.ranks):
        dp_rank = profile.dp_rank_of[rank] if profile.dp_rank_of else rank
        per_dp[dp_rank] = max(per_dp.get(dp_rank, 0.0), values["compute"])
    computes = list(per_dp.values())
    slow_dp = max(per_dp, key=per_dp.get)
    slowest = per_dp[slow_dp]
    median = statistics.median(c for r, c in per_dp.items() if r != slow_dp)  # of the other replicas
    if median <= 0 or slowest < (1 + threshold) * median:
        return None
    ranks = [r for r in range(len(profile.ranks)) if (profile.dp_rank_of[r] if profile.dp_rank_of else r) == slow_dp]
    balanced = len(computes) / sum(1.0 / c for c in computes)
    step = profile.mean("step")
    speedup = step / max(step - (slowest - balanced), 1e-9)
    return Advice(
        f"rank {', '.join(map(str, ranks))} is {slowest / median:.2f}x slower than the others (compute"
        f" {slowest * 1e3:.0f} ms vs {median * 1e3:.0f} ms per step): add DynamicDataBalancer",
        "trainer.callbacks: - class_path: lightning_ciuic.DynamicDataBalancer   (callbacks=[DynamicDataBalancer()])",
        speedup,
        "straggler",
    )


def _data_loading(profile: RunProfile) -> Optional[Advice]:
    step, wait = profile.mean("step"), profile.mean("data_wait")
    if step <= 0 or wait / step <= 0.10:
        return None
    return Advice(
        f"waiting for data is {wait / step:.0%} of each step ({wait * 1e3:.0f} ms): load batches in"
        " background workers",
        "DataLoader(num_workers=<2 or more>, persistent_workers=True)",
        step / max(step - wait, 1e-9),
        "data",
    )


def _bubble(profile: RunProfile) -> Optional[Advice]:
    if profile.pp < 2 or profile.bubble is None or not profile.num_microbatches or profile.bubble <= 0.20:
        return None
    p, m = profile.pp, profile.num_microbatches
    new_bubble = (p - 1) / (2 * m + p - 1)
    speedup = (1 - new_bubble) / (1 - profile.bubble)
    return Advice(
        f"pipeline bubble is {profile.bubble:.0%} of the step: raise num_microbatches to {2 * m}",
        f"strategy.num_microbatches: {2 * m}",
        speedup,
        "bubble",
    )
