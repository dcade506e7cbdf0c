"""Compressed collectives for FSDP2: the gradient reduce-scatter (ZeRO++'s qgZ) and the weight all-gather (qwZ) in
int8.

Contract: :class:`ReduceScatterComm` and :class:`AllGatherComm` are FSDP2 ``ReduceScatter`` / ``AllGather`` objects
(installed per unit with ``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather``) that run the
collective synchronously, add its time (a :class:`~lightning_ciuic.wire.timing.DeviceClock`: on a GPU, events on
the stream FSDP2 runs it on) to the engine's :class:`~lightning_ciuic.comm.grad_sync.SyncStats` as scatter or
gather seconds, and count the bytes this rank sent (ring: (w-1)/w of the gathered or scattered tensor).

With a codec, the reduce-scatter is ZeRO++'s qgZ: FSDP2 hands over the unit's flat gradient laid out as ``world``
equal rows, row ``j`` destined for rank ``j``; each row is encoded once with a dense codec (block-wise int8: 25.4%
of the float32 bytes), the rows are exchanged in one all-to-all, and each rank sums in float32 what it received
(:func:`~lightning_ciuic.comm.collectives.quantized_reduce_scatter`): the quantization error is made once, by the
sender. With ``error_feedback`` what encoding dropped from this rank's gradient is added to its next one (one
residual per unit, the unit's *unsharded* gradient size: it gives back the memory sharding saved on gradients;
turn it off to keep them sharded). ``SUM`` and ``AVG`` are the reductions it implements.

With a codec, the all-gather is qwZ: each rank encodes its flat shard of a unit's parameters once, the codes are
all-gathered, and every rank decodes every rank's part, its own included, so all ranks compute with the same
weights: the values the optimizer updates stay exact in the shards; forward and backward see them within the
codec's bound (absmax of a 256-value block / 254 for int8). No error feedback: the error does not accumulate,
each gather quantizes the current shard anew. A unit whose parameters mix dtypes (FSDP2 then gathers raw bytes)
is gathered uncompressed.

Buffers follow the input's device.

No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from lightning_ciuic import compat
from lightning_ciuic.wire.codecs import Codec
from lightning_ciuic.comm.collectives import quantized_reduce_scatter
from lightning_ciuic.comm.grad_sync import SyncStats
from lightning_ciuic.wire.timing import DeviceClock


def _allocate(size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


class ReduceScatterComm(compat.FSDPReduceScatter):
    """One unit's gradient reduce-scatter: the backend's (``codec=None``) or quantized (qgZ); timed and counted."""

    def __init__(self, stats: SyncStats, clock: DeviceClock, codec: Optional[Codec] = None, error_feedback: bool = True) -> None:
        self.stats, self.clock, self.codec, self.error_feedback = stats, clock, codec, error_feedback
        self.residual: Optional[torch.Tensor] = None

    allocate = staticmethod(_allocate)

    @torch.no_grad()
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: object, async_op: bool = False
    ) -> None:
        start = self.clock.mark()
        world = group.size()
        if self.codec is None:
            dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
            self.stats.bytes_sent += (world - 1) * output_tensor.numel() * output_tensor.element_size()
        else:
            self._quantized(output_tensor, input_tensor, group, op)
        self.stats.collectives += 1
        self.stats.scatters += 1
        self.clock.add(start, self.clock.mark(), self.stats.add_scatter)
        return None

    def _quantized(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: object) -> None:
        assert self.codec is not None
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"a quantized reduce-scatter implements SUM and AVG; FSDP2 asked for the reduction {op}.")
        world = group.size()
        gradient = input_tensor.float()
        if self.error_feedback and self.residual is not None:
            gradient += self.residual.to(gradient.device)  # restored from a checkpoint on the CPU: moved once
        summed, transmitted, sent = quantized_reduce_scatter(gradient.view(world, -1), group, self.codec, transmitted=self.error_feedback)
        if self.error_feedback:
            self.residual = gradient - transmitted.view(-1)
        if op == dist.ReduceOp.AVG:
            summed /= world
        output_tensor.copy_(summed)
        self.stats.bytes_sent += sent


class AllGatherComm(compat.FSDPAllGather):
    """One unit's parameter all-gather: the backend's (``codec=None``) or quantized (qwZ); timed and counted."""

    def __init__(self, stats: SyncStats, clock: DeviceClock, codec: Optional[Codec] = None) -> None:
        self.stats, self.clock, self.codec = stats, clock, codec

    allocate = staticmethod(_allocate)

    @torch.no_grad()
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        start = self.clock.mark()
        world, numel = group.size(), input_tensor.numel()
        # Raw bytes (parameters of mixed dtypes) have nothing to quantize.
        if self.codec is None or not input_tensor.is_floating_point():
            dist.all_gather_single(output_tensor, input_tensor, group=group)
            self.stats.bytes_sent += (world - 1) * numel * input_tensor.element_size()
        else:
            mine = self.codec.encode(input_tensor.float())
            gathered = torch.empty(mine.numel() * world, dtype=torch.uint8, device=mine.device)
            dist.all_gather_single(gathered, mine, group=group)
            # input_tensor is a view into output_tensor (FSDP2 copies the shard in place): it was read above.
            for part, out in zip(gathered.split(mine.numel()), output_tensor.split(numel)):
                out.copy_(self.codec.decode(part, numel))
            self.stats.bytes_sent += (world - 1) * mine.numel()
        self.stats.collectives += 1
        self.stats.gathers += 1
        self.clock.add(start, self.clock.mark(), self.stats.add_gather)
        return None
