"""``communication_compression="auto"``: choose the mode that makes training steps fastest.

Contract of ``AutoCompression(compression).on_step(group, global_step, gradient_numel, buckets)``, called
by every data-parallel rank at the start of every optimizer step (its collectives need all of them):

1. every ``recheck_steps`` optimizer steps (and at step 0) it measures the link — median time of the
   backend's all-reduce at 16 KiB and 4 MiB, fitted to ``t = latency + ring_bytes / bandwidth`` — and this
   machine's encode + decode time per value for every candidate codec, and *predicts* each mode's sync
   time for this model's gradient (``collectives * 2 (w-1) * latency + wire_bytes / bandwidth + codec``);
2. it then *tries* the candidates, fastest predicted first, ``trial_steps`` optimizer steps each, timing
   whole steps (the slowest rank counts), because a prediction cannot see what the hardware does when
   encoding competes with backward for the same cores or when communication hides behind compute. The
   first decision a process takes starts timing only after ``settle_steps`` more steps (run in the mode
   predicted fastest): a process's first steps are slower (allocator, caches, connections), and a
   candidate timed there would lose to the ones timed after;
3. it keeps the mode with the lowest measured step time. All ranks take the same decision (the measured
   times are reduced with MAX across ranks first); it is returned as :class:`AutoDecision`, whose
   ``reason`` (measured link, predictions, measurements) the strategy logs.

Candidates are the dense modes ``none``, ``fp16``, ``int8``, ``nf4`` (their error is bounded and error
feedback covers it); ``topk`` and ``powersgd`` change convergence too much to be picked silently, and so does
DiLoCo: the decision's ``reason`` says when DiLoCo would pay (its steps predicted 1.25x faster or more,
:func:`predicted_diloco_step_seconds`), and auto never switches to it.
The strategy re-decides every ``recheck_steps`` optimizer steps, as link conditions change. Probes and votes
use tensors on ``device`` (the gradients' device: CUDA tensors under NCCL), and timed GPU work is synchronized
before the host clock is read.

No Lightning imports.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_ciuic.wire.codecs import dense_codec
from lightning_ciuic.comm.compression import GradientCompression
from lightning_ciuic.validation import check_int

CANDIDATES = ("none", "fp16", "int8", "nf4")
TRIAL_STEPS = 6  # per candidate; the first is dropped (warm-up of a mode switch)
SETTLE_STEPS = 5  # before a process's first trial: its first steps are slower whatever the mode
_WIRE_FRACTION = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}
DILOCO_SYNC_EVERY = 32  # the round length DiLoCo predictions assume (DiLoCo's default)
DILOCO_PAYS = 1.25  # DiLoCo changes the optimisation: said to pay only for a large predicted gain


@dataclass
class AutoDecision:
    mode: str
    latency_s: float
    bandwidth_bytes_per_s: float
    predicted_s: dict[str, float] = field(default_factory=dict)
    measured_s: dict[str, float] = field(default_factory=dict)

    def diloco_speedup(self, sync_every: int = DILOCO_SYNC_EVERY) -> float:
        """At most how much faster DiLoCo's steps would be than the chosen mode's (its whole predicted sync taken as
        exposed), by :func:`predicted_diloco_step_seconds`; 1.0 before measurements."""
        step = self.measured_s.get(self.mode)
        if not step or "none" not in self.predicted_s:
            return 1.0
        exposed = min(self.predicted_s.get(self.mode, 0.0), step)
        return step / max(predicted_diloco_step_seconds(step, exposed, self.predicted_s["none"], sync_every), 1e-12)

    @property
    def reason(self) -> str:
        def ranked(times: dict[str, float]) -> str:
            return ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in sorted(times.items(), key=lambda kv: kv[1]))

        diloco = self.diloco_speedup()
        return (
            f"communication_compression='auto' chose {self.mode!r}: measured step time {ranked(self.measured_s)};"
            f" link {self.bandwidth_bytes_per_s * 8 / 1e9:.2f} Gbit/s, {self.latency_s * 1e6:.0f} us latency;"
            f" predicted sync {ranked(self.predicted_s)}"
            + (
                f". DiLoCo(sync_every={DILOCO_SYNC_EVERY}) would pay: steps up to {diloco:.2f}x faster predicted; it"
                " changes the optimisation, so auto never picks it (HybridParallelStrategy(diloco=DiLoCo(...)), docs/diloco.md)"
                if diloco >= DILOCO_PAYS else ""
            )
        )


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU), so a host clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_allreduce(numel: int, group: dist.ProcessGroup, repeats: int, device: torch.device) -> float:
    x = torch.zeros(numel, device=device)
    dist.all_reduce(x, group=group)  # warm the connection
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        synchronize(device)  # NCCL returns once the collective is queued, not done
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_link(group: dist.ProcessGroup, repeats: int = 5, device: torch.device = torch.device("cpu")) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/second) of the backend's all-reduce over ``group``, with tensors on
    ``device`` (the gradients' device: CUDA under NCCL)."""
    world = dist.get_world_size(group)
    small, large = 4 * 1024, 1024 * 1024  # float32 values: 16 KiB and 4 MiB
    t_small, t_large = _timed_allreduce(small, group, repeats, device), _timed_allreduce(large, group, repeats, device)
    ring = 2 * (world - 1) / world
    bandwidth = ring * 4 * (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - ring * 4 * small / bandwidth, 0.0) / max(1, 2 * (world - 1))
    return latency, bandwidth


def codec_seconds_per_value(mode: str, sample: int = 1 << 18, device: torch.device = torch.device("cpu")) -> float:
    """Encode + decode time per value on ``device`` (the quantized path decodes twice)."""
    if mode == "none":
        return 0.0
    codec, x = dense_codec(mode), torch.randn(sample, device=device)
    codec.roundtrip(x)
    synchronize(device)
    start = time.perf_counter()
    data = codec.encode(x)
    codec.decode(data, sample)
    codec.decode(data, sample)
    synchronize(device)
    return (time.perf_counter() - start) / sample


def predicted_sync_seconds(
    mode: str, numel: int, buckets: int, world: int, latency: float, bandwidth: float, codec_s: float
) -> float:
    """Predicted time to synchronize ``numel`` gradient values in ``buckets`` buckets over ``world`` ranks:
    per-collective latency, ring traffic of the wire bytes over ``bandwidth`` (bytes/s), and the codec."""
    if mode in _WIRE_FRACTION:
        wire, collectives = 4 * numel * _WIRE_FRACTION[mode], buckets
    else:
        wire, collectives = dense_codec(mode).nbytes(numel), 2 * buckets  # all-to-all + all-gather
    ring = 2 * (world - 1) / world
    return collectives * 2 * (world - 1) * latency + ring * wire / bandwidth + codec_s * numel


def predicted_diloco_step_seconds(step_s: float, exposed_sync_s: float, outer_sync_s: float, sync_every: int) -> float:
    """A step under DiLoCo, predicted from a per-step run: the step without its exposed gradient sync, plus one
    blocking outer sync of the whole model (``outer_sync_s``, about one uncompressed all-reduce of the gradients)
    every ``sync_every`` steps. Fragments spread that sync over the round; the mean is the same."""
    return max(step_s - exposed_sync_s, 0.0) + outer_sync_s / sync_every


def measure_sync_seconds(
    group: dist.ProcessGroup,
    numel: int,
    buckets: int,
    modes: tuple[str, ...] = CANDIDATES,
    repeats: int = 3,
    device: torch.device = torch.device("cpu"),
) -> dict[str, float]:
    """Each mode's measured time to average ``numel`` values in ``buckets`` buckets over ``group`` through the
    reducer training uses (codec, collectives, worker thread), *while this thread computes* (matrix products,
    as backward would): on one machine's cores, compression work competes with compute, and an idle-machine
    measurement misjudges it badly. Median of ``repeats`` after a warm-up; the slowest rank's time, so every
    rank gets the same numbers."""
    sizes = [numel // buckets + (1 if b < numel % buckets else 0) for b in range(max(1, buckets))]
    load = torch.randn(256, 256, device=device)
    result = []
    for mode in modes:
        reducer = GradientCompression(mode, error_feedback=False)
        times = []
        try:
            for attempt in range(repeats + 1):
                buffers = [torch.randn(size, device=device) for size in sizes]
                dist.barrier(group=group)
                synchronize(device)
                start = time.perf_counter()
                pending = [reducer(f"probe{b}", buffer, [buffer.shape], group) for b, buffer in enumerate(buffers)]
                while not all(reduction.done() for reduction in pending):
                    load @ load  # the compute that training overlaps with communication
                for reduction in pending:
                    reduction.wait(timedelta(seconds=300))
                synchronize(device)
                if attempt:
                    times.append(time.perf_counter() - start)
        finally:
            reducer.close()
        result.append(statistics.median(times))
    slowest = torch.tensor(result, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(modes, slowest.tolist()))


class AutoCompression:
    def __init__(
        self,
        compression: GradientCompression,
        recheck_steps: int = 500,
        trial_steps: int = TRIAL_STEPS,
        settle_steps: int = SETTLE_STEPS,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        check_int("auto_recheck_steps", recheck_steps, note="optimizer steps")
        check_int("trial_steps", trial_steps, minimum=2, note="the first step of a trial is dropped")
        check_int("settle_steps", settle_steps, minimum=0)
        self.compression = compression
        self.device = torch.device(device)  # the gradients' device: measurements and votes use tensors there
        self.recheck_steps = recheck_steps
        self.trial_steps = trial_steps
        self.settle_steps = settle_steps
        self._trial_from = 0  # the first optimizer step the trial times
        self.history: list[AutoDecision] = []
        self._pending: AutoDecision | None = None  # the decision being measured
        self._order: list[str] = []
        self._times: dict[str, list[float]] = {}
        self._last: tuple[int, float] | None = None

    def on_step(self, group: dist.ProcessGroup, global_step: int, gradient_numel: int, buckets: int) -> AutoDecision | None:
        """Advance the trial by one optimizer step; returns a decision on the step it is taken."""
        now = time.perf_counter()
        timed = self._last is not None and self._last[0] == global_step - 1 and global_step - 1 >= self._trial_from
        if self._pending is not None and timed:
            self._times.setdefault(self.compression.mode, []).append(now - self._last[1])
        self._last = (global_step, now)
        if self._pending is None:
            if global_step % self.recheck_steps == 0:
                self._start(group, global_step, gradient_numel, buckets)
            return None
        tried = self._times.get(self.compression.mode, [])
        if len(tried) < self.trial_steps:
            return None
        untried = [m for m in self._order if m not in self._times]
        if untried:
            self.compression.set_mode(untried[0], self.compression.algorithm)
            return None
        return self._finish(group)

    def _start(self, group: dist.ProcessGroup, global_step: int, gradient_numel: int, buckets: int) -> None:
        world = dist.get_world_size(group)
        latency, bandwidth = measure_link(group, device=self.device)
        predicted = {
            mode: predicted_sync_seconds(
                mode, gradient_numel, buckets, world, latency, bandwidth, codec_seconds_per_value(mode, device=self.device)
            )
            for mode in CANDIDATES
        }
        box = [predicted]  # the first rank's predictions order the trial everywhere
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        predicted = box[0]
        self._order = sorted(predicted, key=predicted.get)
        self._pending = AutoDecision(self._order[0], latency, bandwidth, predicted)
        self._times = {}
        self._trial_from = global_step + (0 if self.history else self.settle_steps)
        self.compression.set_mode(self._order[0], self.compression.algorithm)

    def _finish(self, group: dist.ProcessGroup) -> AutoDecision:
        medians = torch.tensor(
            [statistics.median(self._times[m][1:]) for m in self._order], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
        decision = self._pending
        assert decision is not None
        decision.measured_s = dict(zip(self._order, medians.tolist()))
        decision.mode = min(decision.measured_s, key=decision.measured_s.get)
        self.compression.set_mode(decision.mode, self.compression.algorithm)
        self.history.append(decision)
        self._pending = None
        return decision
