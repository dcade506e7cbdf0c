"""Tokens to their experts' ranks and back: the routing counted and exchanged, and the rows' all-to-alls.

Contract:

* :func:`routing_of(counts, arriving, ep)`: where one rank's (token, expert) pairs go, from its pairs per expert
  (``counts``) and those the ranks of its group exchanged (``arriving``: one small all-to-all, which
  :func:`~lightning_ciuic.parallel.experts.pairs.pairs_flow` runs): the rows to and from each rank (one device sync),
  and of what arrives, each row's local expert (grouped by source rank, then expert) and the rows of each local expert
  (:class:`Routing`). :func:`balanced_routing`: the same as if every rank of the group routed as many
  pairs as this one, spread evenly over the experts, whatever their values (``ExpertLayout.assume_balanced``: the
  planner's step on fake tensors): the counts exchanged, every size and every tensor allocated as a real balanced
  step's.
* :class:`Exchange` (``Exchange.apply(rows, send_rows, recv_rows, layout, codec, direction, mesh=None, hop=None,
  rows_counted=True)``):
  ``send_rows[j]`` rows to rank ``j`` of ``mesh`` (the ``ep`` group by default; the hierarchical dispatch's hops) by
  ``all_to_all_single`` with uneven splits, forward ``codec``-encoded (each
  destination's rows one block-scaled piece; ``None``: the rows' own bytes, exactly: ``fp8`` e4m3 / ``int8`` codes with
  a float32 scale per 128 values, ``bf16`` a cast), backward the gradients' own bytes. ``direction`` ``"dispatch"`` or
  ``"combine"``: what left this rank is added to ``stats.<direction>_bytes`` / ``_rows``, and by link to
  ``stats.link_bytes[direction]`` (``hop``: the link of every rank of ``mesh``; ``None``: each ep rank's own);
  ``rows_counted=False``: its bytes only (what travels beside rows counted already: their routing weights).
* :func:`all_to_all_timed`: every all-to-all of the dispatch; every rank calls it, with or without anything to send;
  its seconds go to ``layout.stats`` (a :class:`~lightning_ciuic.wire.timing.DeviceClock`: on a GPU, events on the
  stream), and on the CPU each is also a span on the process timeline's ``ep collectives`` track (the monitor's
  trace): a rank with fewer tokens waits there for busier ones.

No Lightning imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.timeline import timeline
from lightning_ciuic.wire.codecs import Codec

if TYPE_CHECKING:
    from lightning_ciuic.parallel.experts.layout import ExpertLayout


def all_to_all_timed(
    received: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int], layout: ExpertLayout, name: str,
    mesh: Optional[DeviceMesh] = None,
) -> torch.Tensor:
    """``all_to_all_single`` over ``mesh`` (the layout's ep group by default), timed into its stats (see the module
    docstring)."""
    clock = layout.clock
    start = clock.mark()
    dist.all_to_all_single(received, send, recv_splits, send_splits, group=(mesh or layout.ep_mesh).get_group())
    end = clock.mark()
    clock.add(start, end, layout.stats.add_seconds)
    clock.add(start, end, layout.stats.add_exposed)  # the caller waited all of it
    if not clock.cuda:  # host times are the collective's own on the CPU; on a GPU they would be its queueing
        timeline.record(f"ep {name}", Axis.EP, start, end, track="ep collectives")
    return received


def _all_to_all_bytes(send: torch.Tensor, send_bytes: list[int], recv_bytes: list[int], layout: ExpertLayout, name: str, mesh: DeviceMesh) -> torch.Tensor:
    """Flat bytes exchanged with uneven splits."""
    return all_to_all_timed(send.new_empty(sum(recv_bytes)), send, recv_bytes, send_bytes, layout, name, mesh)


def _flat_bytes(rows: torch.Tensor) -> torch.Tensor:
    return rows.contiguous().view(-1).view(torch.uint8)


def encode_rows(rows: torch.Tensor, send_rows: list[int], recv_rows: list[int], codec: Optional[Codec]) -> tuple[torch.Tensor, list[int], list[int]]:
    """The bytes of ``rows`` as they cross (``codec``-encoded, each destination's rows one piece; ``None``: their own
    bytes), and the bytes to and from each rank."""
    width = rows.shape[1]
    if codec is None:
        row_bytes = width * rows.element_size()
        return _flat_bytes(rows), [n * row_bytes for n in send_rows], [n * row_bytes for n in recv_rows]
    send_bytes, recv_bytes = [codec.nbytes(n * width) for n in send_rows], [codec.nbytes(n * width) for n in recv_rows]
    return torch.cat([codec.encode(piece.reshape(-1).float()) for piece in rows.split(send_rows)]), send_bytes, recv_bytes


def decode_rows(
    received: torch.Tensor, recv_bytes: list[int], recv_rows: list[int], width: int, dtype: torch.dtype, codec: Optional[Codec],
) -> torch.Tensor:
    """The rows ``received`` (bytes, as :func:`encode_rows` sent them) in ``dtype``: ``[sum(recv_rows), width]``."""
    if codec is None:
        return received.view(dtype).view(-1, width)
    pieces = [codec.decode(piece, n * width).view(n, width) for piece, n in zip(received.split(recv_bytes), recv_rows)]
    return torch.cat(pieces).to(dtype)


def gradient_bytes(grad: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
    """A gradient's own bytes, and the bytes to and from each rank (it crosses back: ``send_rows`` are the forward's
    received rows)."""
    row_bytes = grad.shape[1] * grad.element_size()
    return _flat_bytes(grad), [n * row_bytes for n in send_rows], [n * row_bytes for n in recv_rows]


class Exchange(torch.autograd.Function):
    """Rows to their ranks through an all-to-all (see the module docstring)."""

    @staticmethod
    def forward(ctx, rows, send_rows, recv_rows, layout, codec, direction, mesh=None, hop=None, rows_counted=True):  # type: ignore[override]
        mesh = mesh or layout.ep_mesh
        ctx.send_rows, ctx.recv_rows, ctx.layout, ctx.direction, ctx.mesh = send_rows, recv_rows, layout, direction, mesh
        payload, send_bytes, recv_bytes = encode_rows(rows, send_rows, recv_rows, codec)
        received = _all_to_all_bytes(payload, send_bytes, recv_bytes, layout, direction, mesh)
        counted = send_rows if rows_counted else [0] * len(send_rows)
        layout.stats.count(direction, send_bytes, counted, mesh.get_local_rank(), layout.hop_of(mesh, hop))
        return decode_rows(received, recv_bytes, recv_rows, rows.shape[1], rows.dtype, codec)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        payload, send_bytes, recv_bytes = gradient_bytes(grad, ctx.recv_rows, ctx.send_rows)
        back = _all_to_all_bytes(payload, send_bytes, recv_bytes, ctx.layout, f"{ctx.direction} gradient", ctx.mesh)
        return back.view(grad.dtype).view(-1, grad.shape[1]), None, None, None, None, None, None, None, None


@dataclass(frozen=True)
class Routing:
    """Where one rank's (token, expert) pairs go: rows to each rank of the ep group and rows from each, and, of what
    arrives, the expert of each row (grouped by source rank, then expert) and the rows of each local expert."""

    send_rows: list[int]
    recv_rows: list[int]
    expert_of_row: torch.Tensor
    per_local_expert: list[int]


def routing_of(counts: torch.Tensor, arriving: torch.Tensor, ep: int) -> Routing:
    """Where this rank's pairs go, from its pairs per expert (``counts``, ``[E]``) and the exchanged ones
    (``arriving``: from each source rank, its pairs per local expert of this rank, ``[ep * E / ep]``)."""
    local = counts.numel() // ep
    arriving = arriving.view(ep, local)  # [source rank, local expert] tokens coming here
    sizes = torch.cat([counts.view(ep, local).sum(1), arriving.sum(1), arriving.sum(0)]).tolist()  # one device sync
    send_rows, recv_rows = sizes[:ep], sizes[ep : 2 * ep]
    expert_of_row = torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(
        arriving.reshape(-1), output_size=sum(recv_rows)
    )
    return Routing(send_rows, recv_rows, expert_of_row, sizes[2 * ep :])


def balanced_routing(layout: ExpertLayout, flat: torch.Tensor, n_experts: int, mesh: Optional[DeviceMesh] = None) -> Routing:
    """The routing as if every rank of the ep group routed as many pairs as this one, spread evenly over the experts
    (expert ``e`` gets ``P // E`` of the ``P`` pairs, one more for ``e < P % E``), whatever their values."""
    mesh = mesh or layout.ep_mesh
    ep, me = mesh.size(), mesh.get_local_rank()
    local, pairs = n_experts // ep, flat.numel()
    counts = [pairs // n_experts + (1 if e < pairs % n_experts else 0) for e in range(n_experts)]
    exchanged = flat.new_empty(n_experts)
    all_to_all_timed(torch.empty_like(exchanged), exchanged, [local] * ep, [local] * ep, layout, "counts", mesh)
    mine = counts[me * local : (me + 1) * local]
    arrived = ep * sum(mine)
    expert_of_row = flat.new_empty(arrived)
    return Routing(
        [sum(counts[j * local : (j + 1) * local]) for j in range(ep)], [sum(mine)] * ep, expert_of_row, [ep * n for n in mine],
    )
