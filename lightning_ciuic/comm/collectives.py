"""Averaging collectives that send fewer bytes, and count every byte they send.

Each function averages a flat floating-point tensor ``x`` in place over ``group`` (codecs carry float32; the
native all-reduce keeps ``x``'s dtype) and returns
``(transmitted, bytes_sent)``: ``transmitted`` is what this rank's contribution became after encoding
(what error feedback subtracts from the input), ``bytes_sent`` the payload bytes this rank put on the wire.
Every rank ends with bit-identical results: whatever is encoded once is decoded the same way everywhere.
Every buffer is allocated on ``x``'s device, so the same code runs over gloo on CPU tensors and over NCCL on
CUDA tensors.

* :func:`native_allreduce_` — torch's all-reduce (gloo/NCCL choose the algorithm); in x's dtype, or a 16-bit cast.
  Counted as a ring: ``2 (w-1)/w * bytes``.
* :func:`ring_allreduce_` — reduce-scatter then all-gather around a ring of point-to-point messages,
  ``2 (w-1)`` steps of ``1/w`` of the data: bandwidth-optimal.
* :func:`tree_allreduce_` — binomial-tree reduce to the first rank, then broadcast back down:
  ``2 log2(w)`` steps of the whole tensor: latency-optimal for small tensors.
* :func:`quantized_allreduce_` — for int8/nf4: encode ``w`` chunks, exchange them with one all-to-all
  (rank ``j`` receives everyone's chunk ``j``), decode and sum in float32, re-encode the sum once and
  all-gather it. Quantization error is incurred twice, never once per hop. Its first half,
  :func:`quantized_reduce_scatter`, is also sharded data parallelism's int8 gradient reduce-scatter (qgZ).
* :func:`topk_allreduce_` — all-gather of (index, value) pairs; the average is their scattered sum / w.

No Lightning imports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_ciuic.wire.codecs import Codec, TopK


def _ring_bytes(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


def native_allreduce_(x: torch.Tensor, group: dist.ProcessGroup, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, int]:
    """``all_reduce`` SUM / w, on the wire in ``dtype`` (``x``'s own, or float16 / bfloat16)."""
    world = dist.get_world_size(group)
    wire = x.to(dtype or x.dtype, copy=True)
    transmitted = wire.to(x.dtype, copy=True)
    dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=group)
    x.copy_(wire.to(x.dtype) / world)
    return transmitted, _ring_bytes(wire.numel() * wire.element_size(), world)


def _exchange(send: torch.Tensor, send_to: int, recv: torch.Tensor, recv_from: int, group: dist.ProcessGroup) -> None:
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, send_to), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, recv_from), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _chunks(x: torch.Tensor, world: int, block: int) -> tuple[torch.Tensor, int]:
    """``x`` zero-padded so it splits into ``world`` chunks of whole codec blocks; returns (padded, chunk)."""
    chunk = math.ceil(x.numel() / (world * block)) * block
    padded = x.new_zeros(chunk * world)
    padded[: x.numel()] = x
    return padded, chunk


def ring_allreduce_(x: torch.Tensor, group: dist.ProcessGroup, codec: Codec) -> tuple[torch.Tensor, int]:
    """Ring reduce-scatter + all-gather with every message encoded by ``codec`` (sums stay float32)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return x.clone(), 0
    padded, chunk = _chunks(x, world, codec.block)
    parts = list(padded.split(chunk))
    nxt, prev, sent = (rank + 1) % world, (rank - 1) % world, 0
    transmitted = torch.cat([codec.roundtrip(p) for p in parts])[: x.numel()]
    incoming = torch.empty(codec.nbytes(chunk), dtype=torch.uint8, device=x.device)
    for step in range(world - 1):  # reduce-scatter: after it, rank r owns the sum of chunk (r + 1) % w
        out_index, in_index = (rank - step) % world, (rank - step - 1) % world
        message = codec.encode(parts[out_index])
        _exchange(message, nxt, incoming, prev, group)
        parts[in_index] = parts[in_index] + codec.decode(incoming, chunk)
        sent += message.numel()
    owned = (rank + 1) % world
    encoded = [None] * world
    encoded[owned] = codec.encode(parts[owned] / world)
    for step in range(world - 1):  # all-gather: forward the encoded averages unchanged
        out_index, in_index = (owned - step) % world, (owned - step - 1) % world
        received = torch.empty_like(incoming)
        _exchange(encoded[out_index], nxt, received, prev, group)
        encoded[in_index] = received
        sent += encoded[out_index].numel()
    x.copy_(torch.cat([codec.decode(e, chunk) for e in encoded])[: x.numel()])
    return transmitted, sent


def tree_allreduce_(x: torch.Tensor, group: dist.ProcessGroup, codec: Codec) -> tuple[torch.Tensor, int]:
    """Binomial-tree reduce to group rank 0, average there, broadcast the encoded average down the tree."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return x.clone(), 0
    numel, nbytes, sent = x.numel(), codec.nbytes(x.numel()), 0
    transmitted = codec.roundtrip(x)
    total = x.clone()
    mask = 1
    while mask < world:  # reduce: a rank sends its partial sum up once, at its lowest set bit
        if rank & mask:
            message = codec.encode(total)
            dist.send(message, dist.get_global_rank(group, rank - mask), group=group)
            sent += message.numel()
            break
        if rank + mask < world:
            incoming = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
            dist.recv(incoming, dist.get_global_rank(group, rank + mask), group=group)
            total += codec.decode(incoming, numel)
        mask <<= 1
    result = codec.encode(total / world) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if rank:  # receive from the parent (clear the lowest set bit), then serve children below that bit
        dist.recv(result, dist.get_global_rank(group, rank & (rank - 1)), group=group)
    mask = (rank & -rank) >> 1 if rank else 1 << (world - 1).bit_length() - 1
    while mask:
        if rank + mask < world:
            dist.send(result, dist.get_global_rank(group, rank + mask), group=group)
            sent += result.numel()
        mask >>= 1
    x.copy_(codec.decode(result, numel))
    return transmitted, sent


class _QuantizedExchange:
    """Phase one of a quantized reduction in flight: every row encoded once into one send buffer, exchanged with
    one asynchronous all-to-all; :meth:`sum` waits and adds up in float32 what everyone sent this rank."""

    def __init__(
        self, rows: Sequence[torch.Tensor], group: dist.ProcessGroup, codec: Codec, numel: int,
        sent_into: Sequence[torch.Tensor] | None = None,
    ) -> None:
        device = rows[0].device
        self.codec, self.numel, self.piece = codec, numel, codec.nbytes(numel)
        encoded = torch.empty(self.piece * len(rows), dtype=torch.uint8, device=device)
        for row, out in zip(rows, encoded.split(self.piece)):
            codec.encode_into(row, out, numel)
        self.received = torch.empty_like(encoded)
        self.work = dist.all_to_all_single(self.received, encoded, group=group, async_op=True)
        self.sent = (len(rows) - 1) * self.piece
        for out, row in zip(encoded.split(self.piece), () if sent_into is None else sent_into):  # in flight: rows as sent
            if row.numel():
                codec.decode_into(out, numel, row)

    def sum(self) -> torch.Tensor:
        self.work.wait()
        summed = torch.empty(self.numel, dtype=torch.float32, device=self.received.device)
        for j, part in enumerate(self.received.split(self.piece)):
            self.codec.decode_into(part, self.numel, summed, accumulate=j > 0)
        return summed


def quantized_reduce_scatter(
    chunks: Sequence[torch.Tensor], group: dist.ProcessGroup, codec: Codec, numel: int | None = None, transmitted: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``chunks``: one 1-D tensor per rank of the group, each of at most ``numel`` values (default: the first's
    length; shorter ones count as zero-padded), row ``j`` for rank ``j``. Each row is encoded once into one send
    buffer, the rows are exchanged in one all-to-all, and this rank adds up in float32 what everyone sent it.
    Returns (that sum, the rows as encoded-then-decoded here as a (world, numel) tensor if ``transmitted`` else
    ``None``, bytes sent). No tensor of the whole input's size is made besides the two byte buffers."""
    numel = chunks[0].numel() if numel is None else numel
    sent_rows = torch.empty(len(chunks), numel, dtype=torch.float32, device=chunks[0].device) if transmitted else None
    exchange = _QuantizedExchange(chunks, group, codec, numel, sent_rows)
    return exchange.sum(), sent_rows, exchange.sent


PIPELINE_VALUES = 1 << 20  # values per pipelined part of a quantized all-reduce: 4 MB of float32, ~1 MB of int8


def quantized_allreduce_(
    x: torch.Tensor, group: dist.ProcessGroup, codec: Codec, transmitted: bool = True
) -> tuple[torch.Tensor | None, int]:
    """All-to-all reduce-scatter of encoded chunks, float32 sum, one re-encode, all-gather, decoded straight into
    ``x``. ``transmitted=False`` (no error feedback) skips decoding this rank's own contribution (returns None).

    Pipelined: ``x`` is cut into parts of about :data:`PIPELINE_VALUES` values, whole codec blocks per rank, and
    every part's collectives are asynchronous, so one part's encoding or decoding overlaps another's transfer.
    Quantization blocks start at the same offsets as without parts, so the result is the same bit for bit."""
    world = dist.get_world_size(group)
    if world == 1:
        sent_back = codec.roundtrip(x)
        x.copy_(sent_back)
        return sent_back, 0
    flat = x.view(-1)
    own = torch.empty(flat.numel(), dtype=torch.float32, device=x.device) if transmitted else None
    unit = world * codec.block
    part_values = max(unit, PIPELINE_VALUES // unit * unit)
    exchanges = []
    for start in range(0, flat.numel(), part_values):
        part = flat[start : start + part_values]
        chunk = math.ceil(part.numel() / unit) * codec.block
        rows = [part[j * chunk : (j + 1) * chunk] for j in range(world)]  # views; the last may be short or empty
        sent_into = None if own is None else [own[start + j * chunk : start + min((j + 1) * chunk, part.numel())] for j in range(world)]
        exchanges.append((rows, chunk, _QuantizedExchange(rows, group, codec, chunk, sent_into)))
    gathers, sent = [], 0
    for rows, chunk, exchange in exchanges:
        mine = codec.encode(exchange.sum().div_(world))
        gathered = torch.empty(mine.numel() * world, dtype=torch.uint8, device=x.device)
        gathers.append((rows, chunk, gathered, dist.all_gather_single(gathered, mine, group=group, async_op=True)))
        sent += exchange.sent + (world - 1) * mine.numel()
    for rows, chunk, gathered, work in gathers:
        work.wait()
        for row, part in zip(rows, gathered.split(gathered.numel() // world)):
            if row.numel():
                codec.decode_into(part, chunk, row)
    return own, sent


def topk_allreduce_(x: torch.Tensor, group: dist.ProcessGroup, topk: TopK) -> tuple[torch.Tensor, int]:
    """Each rank contributes its top-k (index, value) pairs; the average is their scattered sum / w."""
    world, numel = dist.get_world_size(group), x.numel()
    indices, values = topk.encode(x)
    transmitted = TopK.decode(indices, values, numel)
    all_indices = indices.new_empty(world * indices.numel())
    all_values = values.new_empty(world * values.numel())
    dist.all_gather_single(all_indices, indices, group=group)
    dist.all_gather_single(all_values, values, group=group)
    x.copy_(TopK.decode(all_indices, all_values, numel) / world)
    return transmitted, (world - 1) * topk.nbytes(numel)
