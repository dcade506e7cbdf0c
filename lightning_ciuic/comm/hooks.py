"""The same codecs for people on plain torch DDP, and the seed's ``GradientQuantizer(bits=8)``.

``register_compression_hook(ddp_model, mode, ...)`` installs a DDP communication hook that averages each
DDP bucket with :class:`~lightning_ciuic.comm.compression.GradientCompression` (any mode but ``"auto"``,
error feedback per bucket, on a background thread so it overlaps backward). It works on CPU/gloo, where
Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers nothing.

``GradientQuantizer(bits=8)`` (seed secret 3) names a quantizer by its bit width — 16: ``fp16``,
8: ``int8``, 4: ``nf4`` — and is usable both ways: ``quantizer.register(ddp_model)`` (the seed's
``model.apply_gradient_compression(quantizer)``), or ``HybridParallelStrategy(communication_compression=quantizer)``.

No Lightning imports. (No ``from __future__ import annotations`` here: DDP checks the hook's annotations.)
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_ciuic.comm.compression import CompressionMode, GradientCompression


class _HookState:
    def __init__(self, compression: GradientCompression, group: Optional[dist.ProcessGroup]) -> None:
        self.compression = compression
        self.group = group or dist.group.WORLD


def _compression_hook(state: "_HookState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    shapes = [g.shape for g in bucket.gradients()]
    result: torch.futures.Future = torch.futures.Future()
    pending = state.compression.submit(f"bucket{bucket.index()}", buffer, shapes, state.group)

    def done(future) -> None:
        error = future.exception()
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(buffer)

    pending.add_done_callback(done)
    return result


def register_compression_hook(
    ddp_model: DistributedDataParallel,
    mode: CompressionMode = "int8",
    group: Optional[dist.ProcessGroup] = None,
    **compression_kwargs,
) -> GradientCompression:
    """Average ``ddp_model``'s gradients with ``mode``; returns the compression state (residuals, stats)."""
    if mode == "auto":
        raise ValueError("mode='auto' needs HybridParallelStrategy (it measures the link at start); pick a fixed mode.")
    compression = GradientCompression(mode=mode, **compression_kwargs)
    ddp_model.register_comm_hook(_HookState(compression, group), _compression_hook)
    return compression


class GradientQuantizer:
    """Seed secret 3: ``GradientQuantizer(bits=8)``; 16 -> fp16, 8 -> block-wise int8, 4 -> nf4."""

    MODES = {16: "fp16", 8: "int8", 4: "nf4"}

    def __init__(self, bits: int = 8, error_feedback: Optional[bool] = None) -> None:
        if bits not in self.MODES:
            raise ValueError(f"GradientQuantizer(bits={bits!r}): use one of {sorted(self.MODES)} (16=fp16, 8=int8, 4=nf4).")
        self.bits = bits
        self.error_feedback = error_feedback

    @property
    def mode(self) -> str:
        return self.MODES[self.bits]

    def register(self, ddp_model: DistributedDataParallel, group: Optional[dist.ProcessGroup] = None) -> GradientCompression:
        """Install this quantizer as ``ddp_model``'s communication hook."""
        return register_compression_hook(ddp_model, self.mode, group, error_feedback=self.error_feedback)

    def __repr__(self) -> str:
        return f"GradientQuantizer(bits={self.bits})"
