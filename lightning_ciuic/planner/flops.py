"""FLOPs a rank's own kernels run: torch's FLOP formulas applied to the local tensors of each op.

Contract: inside :class:`LocalFlops` (a ``TorchDispatchMode``), every op with a formula in
``torch.utils.flop_counter`` (matmuls, convolutions, attention kernels), ``torch._grouped_mm`` (the experts'
grouped GEMM, which it lacks: :func:`grouped_mm_flops`) and the CPU's flash attention (which it lacks too: counted by
its formula for CUDA's flash attention, whose arguments begin alike), adds its FLOPs to ``total``, computed from the shapes of the
tensors it runs on. An op on DTensors is handed to DTensor (the mode returns ``NotImplemented``),
and the local ops DTensor runs are counted: a tensor-parallel matmul counts this rank's shard, not the global
product that ``FlopCounterMode`` counts for a DTensor. Not counted: the ops DTensor's sharding propagation runs on
fake tensors of the global shapes to learn an output's shape (no kernel computes them;
:func:`~lightning_ciuic.compat.dtensor_shape_propagation_marked`). Fake tensors count as real ones do (shapes are all
it reads), so a step on fake tensors counts what the same step on real ones does. ``forward`` is the part counted
outside autograd's backward (recomputed forwards of activation checkpointing run inside it, and are not there).
``experts_forward`` is the part of ``forward`` run inside the packed experts' modules (:func:`experts_modules`: their
forwards, the expert-parallel dispatch's local GEMMs) while :meth:`LocalFlops.watching` them: what the step estimate
scales the step's FLOPs by to find the experts' compute, which the overlapped dispatch hides the other chunk's
all-to-alls behind. ``fp8`` is the part of ``total`` run by FP8 GEMMs (``torch._scaled_mm``:
:mod:`~lightning_ciuic.parallel.fp8`), which the step estimate times at the FP8 rate.

No Lightning imports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import flop_registry

from lightning_ciuic import compat
from lightning_ciuic.parallel.experts.layout import packed_experts


def grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: torch.Tensor, **kwargs: Any) -> int:
    """``torch._grouped_mm``'s FLOPs: two per multiply-add. Every output element contracts ``mat_a``'s last dimension,
    except where both are 2-D (the groups split the contracted dimension: each ``[M, N]`` output of the ``G`` sums its
    group's share, so all of them together contract it once)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    return 2 * out_val.numel() * mat_a.shape[-1]


FORMULAS = {**flop_registry, **compat.private_op_flop_formulas(grouped_mm_flops)}
FP8_GEMMS = (compat.overload_packet(compat.SCALED_MM_OP),)  # counted in ``fp8`` too (overload packets, as FORMULAS' keys)


def experts_modules(module: nn.Module) -> list[nn.Module]:
    """The packed experts' modules of ``module`` (``model.layers.3.mlp.experts``): what runs the routed experts' GEMMs."""
    return [experts for _, experts in packed_experts(module)]


class LocalFlops(compat.WatchesShapePropagation, compat.TorchDispatchMode):
    """Counts this rank's FLOPs (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.forward = 0
        self.experts_forward = 0
        self.fp8 = 0
        self._inside = 0  # the watched modules' forwards running now

    @contextlib.contextmanager
    def watching(self, modules: Sequence[nn.Module]) -> Iterator["LocalFlops"]:
        """Inside, the forward FLOPs run inside ``modules``' forwards also go to ``experts_forward``."""

        def enter(*_: Any) -> None:
            self._inside += 1

        def leave(*_: Any) -> None:
            self._inside -= 1

        handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs the local ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = FORMULAS.get(compat.overload_packet(func))
        if formula is not None and not self.propagating:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.total += flops
            if compat.overload_packet(func) in FP8_GEMMS:
                self.fp8 += flops
            if not compat.in_backward():
                self.forward += flops
                if self._inside:
                    self.experts_forward += flops
        return out
