"""``communication_compression="auto"``: choose the mode that minimizes predicted gradient-sync time.

Contract of ``AutoCompression(compression).decide(group, gradient_numel, buckets)`` (a collective: every
rank of ``group`` calls it at the same point):

1. measures the link: median time of the backend's all-reduce at 16 KiB and 4 MiB, fitted to
   ``t = latency + ring_bytes / bandwidth`` (``ring_bytes = 2 (w-1)/w * bytes``);
2. measures this machine's encode + decode time per value for every candidate codec;
3. predicts, per mode, ``collectives * 2 (w-1) * latency + wire_bytes / bandwidth + codec time`` for this
   model's gradient (``gradient_numel`` values in ``buckets`` buckets) and picks the minimum;
4. the first rank decides and broadcasts, so all ranks switch together; the decision, every prediction
   and the measured link are returned as :class:`AutoDecision` (its ``reason`` is logged).

Candidates are the dense modes ``none``, ``fp16``, ``int8``, ``nf4`` (their error is bounded and error
feedback covers it); ``topk`` and ``powersgd`` change convergence too much to be picked silently.
The strategy re-decides every ``recheck_steps`` optimizer steps, as link conditions change.

No Lightning imports.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_ciuic.comm.codecs import dense_codec
from lightning_ciuic.comm.compression import GradientCompression

CANDIDATES = ("none", "fp16", "int8", "nf4")
_WIRE_FRACTION = {"none": 1.0, "fp16": 0.5}


@dataclass
class AutoDecision:
    mode: str
    latency_s: float
    bandwidth_bytes_per_s: float
    predicted_s: dict[str, float] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        ranked = ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in sorted(self.predicted_s.items(), key=lambda kv: kv[1]))
        return (
            f"communication_compression='auto' chose {self.mode!r}: measured {self.bandwidth_bytes_per_s * 8 / 1e9:.2f} Gbit/s,"
            f" {self.latency_s * 1e6:.0f} us latency; predicted sync per step: {ranked}"
        )


def _timed_allreduce(numel: int, group: dist.ProcessGroup, repeats: int) -> float:
    x = torch.zeros(numel)
    dist.all_reduce(x, group=group)  # warm the connection
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_link(group: dist.ProcessGroup, repeats: int = 5) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/second) of the backend's all-reduce over ``group``."""
    world = dist.get_world_size(group)
    small, large = 4 * 1024, 1024 * 1024  # float32 values: 16 KiB and 4 MiB
    t_small, t_large = _timed_allreduce(small, group, repeats), _timed_allreduce(large, group, repeats)
    ring = 2 * (world - 1) / world
    bandwidth = ring * 4 * (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - ring * 4 * small / bandwidth, 0.0) / max(1, 2 * (world - 1))
    return latency, bandwidth


def codec_seconds_per_value(mode: str, sample: int = 1 << 18) -> float:
    """Encode + decode time per value on this machine (the quantized path decodes twice)."""
    if mode == "none":
        return 0.0
    codec, x = dense_codec(mode), torch.randn(sample)
    codec.roundtrip(x)
    start = time.perf_counter()
    data = codec.encode(x)
    codec.decode(data, sample)
    codec.decode(data, sample)
    return (time.perf_counter() - start) / sample


class AutoCompression:
    def __init__(self, compression: GradientCompression, recheck_steps: int = 500) -> None:
        if recheck_steps < 1:
            raise ValueError(f"auto recheck interval must be >= 1 optimizer step, got {recheck_steps}.")
        self.compression = compression
        self.recheck_steps = recheck_steps
        self.history: list[AutoDecision] = []

    def predict(self, mode: str, numel: int, buckets: int, world: int, latency: float, bandwidth: float, codec_s: float) -> float:
        if mode in _WIRE_FRACTION:
            wire, collectives = 4 * numel * _WIRE_FRACTION[mode], buckets
        else:
            wire, collectives = dense_codec(mode).nbytes(numel), 2 * buckets  # all-to-all + all-gather
        ring = 2 * (world - 1) / world
        return collectives * 2 * (world - 1) * latency + ring * wire / bandwidth + codec_s * numel

    def decide(self, group: dist.ProcessGroup, gradient_numel: int, buckets: int) -> AutoDecision:
        world = dist.get_world_size(group)
        latency, bandwidth = measure_link(group)
        predicted = {
            mode: self.predict(mode, gradient_numel, buckets, world, latency, bandwidth, codec_seconds_per_value(mode))
            for mode in CANDIDATES
        }
        decision = AutoDecision(min(predicted, key=predicted.get), latency, bandwidth, predicted)
        box = [decision]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        decision = box[0]
        self.compression.set_mode(decision.mode, self.compression.algorithm)
        self.history.append(decision)
        return decision
