"""Data-parallel gradient synchronization: buckets, overlap with backward, no-sync, timeout.

Contract of ``GradientSynchronizer(parameters, group, ...)``:

* Trainable parameters are packed, in reverse registration order (roughly the order backward produces
  their gradients), into flat buckets of at most ``bucket_size_mb`` per dtype and device; the first
  bucket holds at most 1 MB (as in torch DDP) so communication starts early in backward.
* A post-accumulate-grad hook copies each gradient (the local shard of a DTensor gradient) into its
  bucket. Buckets are launched strictly in index order as soon as they are complete, so every rank
  issues the same collectives in the same order and communication overlaps the rest of backward.
* ``finish()`` (called after backward) launches what is left, waits with ``timeout`` seconds per
  collective, and writes the averaged gradient back. A parameter that got no gradient on this rank
  contributes zeros and still receives the average, so replicas never diverge. A collective that does
  not finish in time raises :class:`GradientSyncTimeoutError` naming the bucket, the axis and the timeout.
* Inside ``no_sync()`` hooks do nothing: gradients accumulate locally (``accumulate_grad_batches``).
  ``sync_accumulated()`` averages such locally accumulated gradients afterwards, without overlap (for
  pipeline schedules, whose micro-batches each run a backward pass).
* How a bucket is reduced is the one seam for compression: ``reducer(key, buffer, shapes, group)`` turns
  a flat buffer into an in-flight operation whose ``wait`` returns the bytes sent; the default is an exact
  mean (the backend's ``all_reduce`` SUM of the pre-divided buffer), the strategy passes
  :class:`~lightning_ciuic.comm.compression.GradientCompression` for the compressed modes.
* :attr:`stats` counts collectives, bytes and seconds; on a GPU the seconds come from CUDA events and may lag
  by a step (:class:`~lightning_ciuic.wire.timing.DeviceClock`).

No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from lightning_ciuic.wire.timing import DeviceClock
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.tensor import gradient_to_parameter_placements


class GradientSyncTimeoutError(RuntimeError):
    """A gradient collective did not complete within ``sync_timeout`` seconds."""


class PendingReduction(Protocol):
    def wait(self, timeout: timedelta) -> int:
        """Block until done (or raise after ``timeout``); return the payload bytes this rank sent."""
        ...

    def done(self) -> bool:
        """Whether the reduction has completed (never blocks)."""
        ...


class BucketReducer(Protocol):
    """Starts averaging ``buffer`` (made of tensors of ``shapes``) in place across ``group``; ``key`` names the
    bucket for codecs that keep per-bucket state (error feedback, PowerSGD)."""

    def __call__(self, key: str, buffer: torch.Tensor, shapes: list[torch.Size], group: dist.ProcessGroup) -> PendingReduction: ...


class _NativeReduction:
    def __init__(self, work: dist.Work | None, nbytes: int) -> None:
        self.work, self.nbytes = work, nbytes

    def wait(self, timeout: timedelta) -> int:
        if self.work is not None:
            self.work.wait(timeout)
        return self.nbytes

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()


def mean_all_reduce(key: str, buffer: torch.Tensor, shapes: list[torch.Size], group: dist.ProcessGroup) -> PendingReduction:
    """Exact average: divide by the group size, then the backend's asynchronous ``all_reduce`` SUM
    (bytes counted as a ring all-reduce: ``2 (w-1)/w`` of the buffer)."""
    size = dist.get_world_size(group)
    if size == 1:
        return _NativeReduction(None, 0)
    buffer.div_(size)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _NativeReduction(work, 2 * (size - 1) * buffer.numel() * buffer.element_size() // size)


@dataclass
class SyncStats:
    """Counters since construction: bucket reductions launched, gradient bytes reduced (float32 payload),
    bytes this rank sent on the wire, seconds spent waiting for them after backward, and seconds from the
    first launch of a step to the end of its last reduction (communication time, overlapped or not); for a
    sharded engine, the seconds of its all-gathers and reduce-scatters."""

    collectives: int = 0
    bytes_reduced: int = 0
    bytes_sent: int = 0
    wait_seconds: float = 0.0
    comm_seconds: float = 0.0
    gather_seconds: float = 0.0  # sharded: parameter all-gathers (also in comm_seconds)
    scatter_seconds: float = 0.0  # sharded: gradient reduce-scatters (also in comm_seconds)
    gathers: int = 0  # sharded: parameter all-gathers run (also in collectives)
    scatters: int = 0  # sharded: gradient reduce-scatters run (also in collectives)

    def __add__(self, other: "SyncStats") -> "SyncStats":
        """Both counters added field by field (an engine's groups together)."""
        return SyncStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def add_wait(self, seconds: float) -> None:
        self.wait_seconds += seconds

    def add_comm(self, seconds: float) -> None:
        self.comm_seconds += seconds

    def add_gather(self, seconds: float) -> None:
        self.gather_seconds += seconds
        self.comm_seconds += seconds

    def add_scatter(self, seconds: float) -> None:
        self.scatter_seconds += seconds
        self.comm_seconds += seconds


@dataclass
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    ready: list[bool] = field(default_factory=list)
    pending: PendingReduction | None = None

    def __post_init__(self) -> None:
        self.ready = [False] * len(self.params)

    @property
    def complete(self) -> bool:
        return all(self.ready)

    def slice(self, slot: int) -> torch.Tensor:
        start = self.offsets[slot]
        return self.buffer[start : start + local_tensor(self.params[slot]).numel()]


def check_bucket_size(bucket_size_mb: float) -> None:
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb!r} (25.0 is a good default).")


FIRST_BUCKET_BYTES = 1024 * 1024  # as torch DDP: a small first bucket starts communication early in backward


def _make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    groups: dict[tuple[torch.device, torch.dtype], list[list[torch.nn.Parameter]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}  # bytes in each group's last chunk
    for p in reversed(params):
        local = local_tensor(p)
        key, size = (local.device, local.dtype), local.numel() * local.element_size()
        chunks = groups.setdefault(key, [[]])
        cap = min(bucket_bytes, FIRST_BUCKET_BYTES) if len(chunks) == 1 else bucket_bytes
        if chunks[-1] and filled.get(key, 0) + size > cap:
            chunks.append([])
            filled[key] = 0
        chunks[-1].append(p)
        filled[key] = filled.get(key, 0) + size
    buckets = []
    for (device, dtype), chunks in groups.items():
        for chunk in chunks:
            offsets, total = [], 0
            for p in chunk:
                offsets.append(total)
                total += local_tensor(p).numel()
            buckets.append(_Bucket(len(buckets), chunk, offsets, torch.zeros(total, dtype=dtype, device=device)))
    return buckets


class GradientSynchronizer:
    """Averages gradients of ``parameters`` over ``group`` during backward (see module docstring)."""

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        group: dist.ProcessGroup,
        bucket_size_mb: float = 25.0,
        timeout: float = 300.0,
        axis_name: str = Axis.DP,
        reducer: BucketReducer = mean_all_reduce,
    ) -> None:
        check_bucket_size(bucket_size_mb)
        if timeout <= 0:
            raise ValueError(f"sync_timeout must be > 0 seconds, got {timeout!r} (the default is 300.0).")
        self.group = group
        self.timeout = timedelta(seconds=float(timeout))
        self.axis_name = axis_name
        self.reducer = reducer
        self.stats = SyncStats()
        self._enabled = True
        self._next_bucket = 0
        self._first_launch: object = 0.0
        params = [p for p in parameters if p.requires_grad]
        self.buckets = _make_buckets(params, int(bucket_size_mb * 1024 * 1024))
        # times communication on the gradients' device: CUDA events under NCCL, read without blocking
        self.clock = DeviceClock(self.buckets[0].buffer.device if self.buckets else torch.device("cpu"))
        self._slots = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    # -- lifecycle ---------------------------------------------------------------------------------
    def remove(self) -> None:
        """Detach the hooks (and settle pending timings); the synchronizer does nothing afterwards."""
        self.clock.collect(wait=True)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Let gradients accumulate locally for the backward passes run inside this context."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    @torch.no_grad()
    def broadcast_parameters(self, tensors: Iterable[torch.Tensor]) -> None:
        """Make ``tensors`` (parameters and buffers) equal on every rank of the group, from its first rank."""
        if dist.get_world_size(self.group) == 1:
            return
        src = dist.get_global_rank(self.group, 0)
        for tensor in tensors:
            dist.broadcast(local_tensor(tensor).data, src=src, group=self.group)

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._enabled:
            return
        bucket, slot = self._slots[id(param)]
        gradient_to_parameter_placements(param)  # this rank's slot holds the parameter's own shard of its gradient
        bucket.slice(slot).copy_(local_tensor(param.grad).reshape(-1))
        bucket.ready[slot] = True
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].complete:
            self._launch(self.buckets[self._next_bucket])

    def _launch(self, bucket: _Bucket) -> None:
        for slot, ready in enumerate(bucket.ready):
            if not ready:  # no gradient on this rank: contribute zeros
                bucket.slice(slot).zero_()
        shapes = [local_tensor(p).shape for p in bucket.params]
        if bucket.index == 0:
            self._first_launch = self.clock.mark()
        bucket.pending = self.reducer(f"bucket{bucket.index}", bucket.buffer, shapes, self.group)
        self.stats.collectives += 1
        self.stats.bytes_reduced += bucket.buffer.numel() * bucket.buffer.element_size()
        self._next_bucket = bucket.index + 1

    @torch.no_grad()
    def sync_accumulated(self) -> None:
        """Average the gradients accumulated inside ``no_sync()`` now (no-op while sync is disabled)."""
        if not self._enabled or not self._handles:
            return
        for bucket in self.buckets:
            for p in bucket.params:
                if p.grad is not None:
                    self._on_grad_ready(p)
        self.finish()

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the remaining buckets, wait for all, and write the averaged gradients back."""
        if not self._enabled or not self._handles:
            return
        for bucket in self.buckets[self._next_bucket :]:
            self._launch(bucket)
        start = self.clock.mark()
        for bucket in self.buckets:
            self._wait(bucket)
            for slot, p in enumerate(bucket.params):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local = local_tensor(p.grad)
                local.copy_(bucket.slice(slot).view_as(local))
            bucket.ready = [False] * len(bucket.params)
            bucket.pending = None
        end = self.clock.mark()  # on a GPU: after the copies, which wait for the collectives on the stream
        self.clock.add(start, end, self.stats.add_wait)
        self.clock.add(self._first_launch, end, self.stats.add_comm)
        self._next_bucket = 0

    def _wait(self, bucket: _Bucket) -> None:
        assert bucket.pending is not None
        try:
            self.stats.bytes_sent += bucket.pending.wait(self.timeout)
        except RuntimeError as err:
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            numel = bucket.buffer.numel()
            raise GradientSyncTimeoutError(
                f"gradient all-reduce of bucket {bucket.index} ({len(bucket.params)} parameters, {numel} elements)"
                f" over mesh axis '{self.axis_name}' (ranks {dist.get_process_group_ranks(self.group)}) did not finish"
                f" within sync_timeout={self.timeout.total_seconds():g}s. A peer rank stalled or died; raise"
                f" `sync_timeout` if steps are legitimately slower than that."
            ) from err
