"""Compressed collectives for FSDP2: the gradient reduce-scatter in int8 (ZeRO++'s qgZ).

Contract: :class:`QuantizedReduceScatter` is an FSDP2 ``ReduceScatter`` (installed per unit with
``FSDPModule.set_custom_reduce_scatter``). FSDP2 hands it the unit's flat gradient laid out as ``world`` equal rows,
row ``j`` destined for rank ``j``; each row is encoded once with a dense codec (block-wise int8: 25.4% of the
float32 bytes), the rows are exchanged in one all-to-all, and each rank sums in float32 what it received
(:func:`~lightning_ciuic.comm.collectives.quantized_reduce_scatter`): the quantization error is made once, by the
sender. With ``error_feedback`` what encoding dropped from this rank's gradient is added to its next one (one
residual per unit, the unit's *unsharded* gradient size: it gives back the memory sharding saved on gradients;
turn it off to keep them sharded). ``SUM`` and ``AVG`` are the reductions FSDP2 asks for; the bytes sent are added
to the engine's :class:`~lightning_ciuic.comm.grad_sync.SyncStats`. Buffers follow the input's device.

No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from lightning_ciuic import compat
from lightning_ciuic.comm.codecs import Codec
from lightning_ciuic.comm.collectives import quantized_reduce_scatter
from lightning_ciuic.comm.grad_sync import SyncStats


class QuantizedReduceScatter(compat.FSDPReduceScatter):
    def __init__(self, codec: Codec, error_feedback: bool, stats: SyncStats) -> None:
        self.codec, self.error_feedback, self.stats = codec, error_feedback, stats
        self.residual: Optional[torch.Tensor] = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: object, async_op: bool = False
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"QuantizedReduceScatter: FSDP2 asked for the reduction {op}; it implements SUM and AVG.")
        world = group.size()
        gradient = input_tensor.float()
        if self.error_feedback and self.residual is not None:
            gradient += self.residual.to(gradient.device)  # restored from a checkpoint on the CPU: moved once
        summed, transmitted, sent = quantized_reduce_scatter(gradient.view(world, -1), group, self.codec)
        if self.error_feedback:
            self.residual = gradient - transmitted.view(-1)
        if op == dist.ReduceOp.AVG:
            summed /= world
        output_tensor.copy_(summed)
        self.stats.bytes_sent += sent
        self.stats.collectives += 1
        return None
