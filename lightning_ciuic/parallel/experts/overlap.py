"""One chunk's expert all-to-alls in flight while another chunk computes: exchanges that can be waited later, and
the schedule that interleaves the chunks' dispatches.

Contract:

* A *flow* is a generator that runs one chunk's dispatch and combine: at each exchange it yields a pending exchange
  (anything with ``wait()``, which returns what arrived) and is sent back what arrived. :func:`run_alone(flow)` runs
  one flow, each exchange waited at once (the dispatch without overlap); :func:`run_interleaved(flows)` runs the
  flows in turn, each up to its next exchange, which stays in flight while the others run up to theirs: with two
  chunks, chunk 1's dispatch is in flight while chunk 0's experts compute, and chunk 0's combine while chunk 1's
  experts compute. Both return each flow's result. Every rank runs the same flows, so the collectives of each group
  are issued in the same order on every rank, whatever the tokens (a chunk with no token still exchanges).
* :func:`exchange(rows, send_rows, recv_rows, layout, codec, direction, mesh, hop, overlap, rows_counted=True)`: the rows'
  all-to-all of :class:`~lightning_ciuic.parallel.experts.dispatch.Exchange` (same bytes, codec, counters). Not
  ``overlap``: ``Exchange`` itself, run at once. ``overlap``: issued asynchronously (``async_op``) and waited by
  ``wait()``, two autograd nodes apart: the backward of the wait issues the gradient's reverse all-to-all
  asynchronously, the backward of the issue waits for it. Autograd runs the ready node created last first, so in
  backward one chunk's gradient all-to-all is in flight while the other chunk's experts run backward (chunk 0's
  combine gradient while chunk 1's experts, chunk 1's dispatch gradient while chunk 0's: forward's interleaving,
  reversed). :func:`transfer(tensor, ...)`: a tensor without gradient
  (the hierarchical dispatch's int32 codes), the same way. :func:`together(*pending)`: several waited as one.
  :func:`chunks(tokens, count=CHUNKS)`: the slices of the tokens the chunks take (consecutive, the first ones a token
  longer where they do not divide; a chunk may be empty).
* Inside one side of a forward-backward pair (:mod:`~lightning_ciuic.parallel.paired_overlap`), an asynchronous
  exchange's ``wait()`` first gives the turn to the other side if this side issued an exchange in its turn: the
  other micro-batch computes while it is in flight.
* Time (into ``layout.stats``): an asynchronous all-to-all's wall time is from its issue to its completion (on the
  CPU the moment its completion callback runs, on a GPU the moment the stream passes its wait: an upper bound), added
  to ``seconds``; the time the caller spent blocked in ``wait()`` until that completion (on a GPU: the stream's stall
  there, CUDA events) to ``exposed_seconds``, never more than ``seconds``; a synchronous one adds its time to both
  (:func:`~lightning_ciuic.parallel.experts.dispatch.all_to_all_timed`). The hidden part of the all-to-alls is
  ``1 - exposed_seconds / seconds``. On the CPU each wait is a span of the process timeline's ``ep collectives``
  track (the training thread blocked there).

No Lightning imports.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.parallel import paired_overlap
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.experts.dispatch import Exchange, all_to_all_timed, decode_rows, encode_rows, gradient_bytes
from lightning_ciuic.timeline import timeline
from lightning_ciuic.wire.codecs import Codec

if TYPE_CHECKING:
    from lightning_ciuic.parallel.experts.layout import ExpertLayout

Flow = Generator[Any, Any, torch.Tensor]
CHUNKS = 2  # the overlapped dispatch's chunks per micro-batch (the step estimate models the same)


class Ready:
    """An exchange already done: ``wait()`` returns its result."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


class _Together:
    def __init__(self, pending: Sequence[Any]) -> None:
        self.pending = pending

    def wait(self) -> tuple:
        return tuple(p.wait() for p in self.pending)


def together(*pending: Any) -> _Together:
    """Several pending exchanges waited as one (``wait()``: their results, in order)."""
    return _Together(pending)


def run_alone(flow: Flow) -> torch.Tensor:
    """One flow, each of its exchanges waited at once."""
    try:
        pending = next(flow)
        while True:
            pending = flow.send(pending.wait())
    except StopIteration as done:
        return done.value


def run_interleaved(flows: Sequence[Flow]) -> list[torch.Tensor]:
    """The flows in turn, each up to its next exchange, which stays in flight while the others run (module docstring)."""
    results: list[Any] = [None] * len(flows)
    pending: list[Any] = [None] * len(flows)
    live = list(range(len(flows)))
    for i in live[:]:
        try:
            pending[i] = next(flows[i])
        except StopIteration as done:
            results[i] = done.value
            live.remove(i)
    while live:
        for i in live[:]:
            try:
                pending[i] = flows[i].send(pending[i].wait())
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return results


class _InFlight:
    """An all-to-all issued with ``async_op``: ``wait()`` returns the received tensor and times it (module docstring)."""

    def __init__(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], layout: ExpertLayout, name: str, mesh: DeviceMesh) -> None:
        self.layout, self.name, self.send = layout, name, send  # the send buffer lives until the all-to-all is done
        self.received = send.new_empty(sum(recv_splits))
        self.done: Optional[float] = None
        self.issued = layout.clock.mark()
        self.work = dist.all_to_all_single(self.received, send, recv_splits, send_splits, group=mesh.get_group(), async_op=True)
        paired_overlap.issued()
        if not layout.clock.cuda:
            self.work.get_future().add_done_callback(self._completed)

    def _completed(self, _future: Any) -> None:
        self.done = time.perf_counter()

    def wait(self) -> torch.Tensor:
        paired_overlap.before_wait()  # in a forward-backward pair, the other side runs while this one is in flight
        clock, stats = self.layout.clock, self.layout.stats
        start = clock.mark()
        self.work.wait()
        end = clock.mark()
        if clock.cuda:
            clock.add(start, end, stats.add_exposed)
            clock.add(self.issued, end, stats.add_seconds)
        else:  # blocked until it completed: the wake-up after its callback is the scheduler's, not the exchange's
            completed = min(self.done if self.done is not None else end, end)
            stats.add_seconds(completed - self.issued)
            stats.add_exposed(max(0.0, completed - start))
            timeline.record(f"ep {self.name}", Axis.EP, start, end, track="ep collectives")
        self.send = None
        return self.received


class _Channel:
    """One exchange of rows in flight, forward and backward: what the two autograd nodes share."""

    def __init__(self, send_rows, recv_rows, layout, codec, direction, mesh, hop, rows_counted) -> None:
        self.send_rows, self.recv_rows, self.layout, self.codec = send_rows, recv_rows, layout, codec
        self.direction, self.mesh, self.hop, self.rows_counted = direction, mesh, hop, rows_counted

    def send_forward(self, rows: torch.Tensor) -> None:
        self.width, self.dtype = rows.shape[1], rows.dtype
        payload, send_bytes, self.recv_bytes = encode_rows(rows, self.send_rows, self.recv_rows, self.codec)
        self.forward = _InFlight(payload, send_bytes, self.recv_bytes, self.layout, self.direction, self.mesh)
        me, links = self.mesh.get_local_rank(), self.layout.hop_of(self.mesh, self.hop)
        counted = self.send_rows if self.rows_counted else [0] * len(self.send_rows)
        self.layout.stats.count(self.direction, send_bytes, counted, me, links)

    def receive_forward(self) -> torch.Tensor:
        received = self.forward.wait()
        self.forward = None
        return decode_rows(received, self.recv_bytes, self.recv_rows, self.width, self.dtype, self.codec)

    def send_backward(self, grad: torch.Tensor) -> None:
        payload, send_bytes, recv_bytes = gradient_bytes(grad, self.recv_rows, self.send_rows)
        self.grad_dtype = grad.dtype
        self.backward = _InFlight(payload, send_bytes, recv_bytes, self.layout, f"{self.direction} gradient", self.mesh)

    def receive_backward(self) -> torch.Tensor:
        back = self.backward.wait()
        self.backward = None
        return back.view(self.grad_dtype).view(-1, self.width)


class _Issue(torch.autograd.Function):
    """Forward: the rows' all-to-all issued; backward: the gradient's reverse all-to-all waited for."""

    @staticmethod
    def forward(ctx, rows, channel):  # type: ignore[override]
        channel.send_forward(rows)
        ctx.channel = channel
        return rows.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):  # type: ignore[override]
        return ctx.channel.receive_backward(), None


class _Wait(torch.autograd.Function):
    """Forward: the rows' all-to-all waited for; backward: the gradient's reverse all-to-all issued."""

    @staticmethod
    def forward(ctx, token, channel):  # type: ignore[override]
        ctx.channel = channel
        return channel.receive_forward()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.channel.send_backward(grad)
        return grad.new_empty(0), None


class _PendingRows:
    def __init__(self, token: torch.Tensor, channel: _Channel) -> None:
        self.token, self.channel = token, channel

    def wait(self) -> torch.Tensor:
        return _Wait.apply(self.token, self.channel)


def exchange(
    rows: torch.Tensor, send_rows: list[int], recv_rows: list[int], layout: ExpertLayout, codec: Optional[Codec],
    direction: str, mesh: Optional[DeviceMesh], hop: Optional[str], overlap: bool, rows_counted: bool = True,
) -> Any:
    """The rows' all-to-all, pending (see the module docstring)."""
    mesh = mesh or layout.ep_mesh
    if not overlap:
        return Ready(Exchange.apply(rows, send_rows, recv_rows, layout, codec, direction, mesh, hop, rows_counted))
    channel = _Channel(send_rows, recv_rows, layout, codec, direction, mesh, hop, rows_counted)
    return _PendingRows(_Issue.apply(rows, channel), channel)


def transfer(tensor: torch.Tensor, send: list[int], recv: list[int], layout: ExpertLayout, name: str, mesh: DeviceMesh, overlap: bool) -> Any:
    """A tensor without gradient to the ranks of ``mesh`` (``send[j]`` elements to rank ``j``), pending."""
    if not overlap:
        return Ready(all_to_all_timed(tensor.new_empty(sum(recv)), tensor, recv, send, layout, name, mesh))
    return _InFlight(tensor.contiguous(), send, recv, layout, name, mesh)


def chunks(tokens: int, count: int = CHUNKS) -> list[slice]:
    """``count`` consecutive slices of ``tokens`` rows, the first ones a row longer where they do not divide."""
    sizes = [tokens // count + (1 if i < tokens % count else 0) for i in range(count)]
    starts = [sum(sizes[:i]) for i in range(count)]
    return [slice(start, start + size) for start, size in zip(starts, sizes)]
