"""This rank's experts on the rows routed to them: SwiGLU per expert, by grouped GEMM where it fits.

Contract: :func:`run_local_experts(experts, rows, counts, grad_scale, row_weights=None)` takes ``rows`` sorted by
local expert (``counts[e]`` rows for expert ``e``) and returns, row by row, ``down_proj[e] @ (act_fn(gate) * up * w)``,
``gate`` and ``up`` the first and last ``I`` rows of ``gate_up_proj[e] @ row`` and ``w`` the row's routing weight
(``row_weights``, in the intermediate's dtype; ``None``: 1). With ``fp8``, each expert's two products are FP8 GEMMs
(:func:`~lightning_ciuic.parallel.fp8.fp8_linear`: forward and input gradient in e4m3 with a scale per row, the
weights' gradients unquantized), one expert after another. A weight taken before the down-projection rather than on
its output (as Megatron-LM's experts do) is the same sum, and its gradient reads the ``[rows, I]`` intermediate, not
the ``[rows, H]`` output, which autograd then does not keep. It runs torch's grouped GEMM
(:func:`lightning_ciuic.compat.grouped_mm`) for float32/bf16/fp16 rows of 16-byte multiples, else a loop over the
experts (float64, odd widths). The weights' gradients are scaled by ``grad_scale`` on their way back
(:mod:`~lightning_ciuic.parallel.experts.grad_scale`).

The SwiGLU's output is recomputed in backward from its input (:func:`gated`, as DeepSeek-V3 trains): autograd keeps
the ``[rows, 2I]`` gate/up product and the weights only, not ``act_fn(gate)`` or ``act_fn(gate) * up`` besides
(``[rows, I]`` each per mixture-of-experts layer and micro-batch); the gradients are autograd's ops on the same values,
so the same bits.

No Lightning imports.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_ciuic import compat
from lightning_ciuic.parallel.experts.grad_scale import ScaleGradient
from lightning_ciuic.parallel.experts.storage import kept_encoded
from lightning_ciuic.parallel.fp8 import fp8_linear
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.wire.codecs import Codec

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def run_local_experts(
    experts: Any, rows: torch.Tensor, counts: Sequence[int], grad_scale: float, row_weights: Optional[torch.Tensor] = None,
    input_codec: Optional[Codec] = None, fp8: bool = False,
) -> torch.Tensor:
    """This rank's experts on ``rows`` sorted by local expert (``counts[e]`` rows each): SwiGLU per expert, each row's
    intermediate times its ``row_weights`` entry. ``experts``: anything with ``gate_up_proj``, ``down_proj`` (tensors
    or DTensors: their local part) and ``act_fn``. ``input_codec``: ``rows`` and the SwiGLU's input (the gate/up
    product) kept for backward in that encoding (:mod:`~lightning_ciuic.parallel.experts.storage`), as DeepSeek-V3
    keeps both in fp8. ``fp8``: the products by FP8 GEMMs (module docstring)."""
    gate_up = ScaleGradient.apply(local_tensor(experts.gate_up_proj), grad_scale)
    down = ScaleGradient.apply(local_tensor(experts.down_proj), grad_scale)
    if not fp8 and _grouped_mm_fits(rows, gate_up, down):
        offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=rows.device)
        with kept_encoded(rows, input_codec):
            hidden = compat.grouped_mm(rows, gate_up.transpose(-2, -1), offsets)
        with kept_encoded(hidden, input_codec):
            intermediate = gated(hidden, experts.act_fn, row_weights)
        return compat.grouped_mm(intermediate.contiguous(), down.transpose(-2, -1), offsets)
    linear = fp8_linear if fp8 else nn.functional.linear
    hidden = []
    for e, chunk in enumerate(rows.split(list(counts))):
        with kept_encoded(chunk, input_codec):  # each expert's rows apart: its backward decodes them alone
            hidden.append(linear(chunk, gate_up[e]))
    outputs = []
    weights = row_weights.split(list(counts)) if row_weights is not None else [None] * len(counts)
    for e, (projected, weight) in enumerate(zip(hidden, weights)):
        with kept_encoded(projected, input_codec):
            intermediate = gated(projected, experts.act_fn, weight)
        outputs.append(linear(intermediate, down[e]))
    return torch.cat(outputs) if outputs else rows.new_empty((0, down.shape[1]))


def _grouped_mm_fits(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """torch's grouped GEMM: float32/bf16/fp16, every row a multiple of 16 bytes."""
    if not compat.has_grouped_mm() or rows.dtype not in _GROUPED_MM_DTYPES or gate_up.dtype != rows.dtype:
        return False
    size = rows.element_size()
    return all((d * size) % 16 == 0 for d in (gate_up.shape[-1], gate_up.shape[-2] // 2, down.shape[-2]))


def gated(hidden: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor], weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``act_fn(gate) * up * weights[:, None]`` of ``hidden = [gate | up]`` (last dimension; ``weights`` ``[rows]``
    cast to the product's dtype, ``None``: 1), ``act_fn(gate)`` and the product recomputed in backward."""
    return _Gated.apply(hidden, weights, act_fn)


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weights, act_fn):  # type: ignore[override]
        gate, up = hidden.detach().chunk(2, dim=-1)  # detached: module hooks (MemTracker's) see no autograd input
        ctx.act_fn = act_fn.forward if isinstance(act_fn, nn.Module) else act_fn  # again in backward: without hooks
        product = act_fn(gate) * up
        ctx.weights_dtype = None if weights is None else weights.dtype
        weights = None if weights is None else weights.to(product.dtype)
        ctx.save_for_backward(hidden, weights)
        return product if weights is None else product * weights.unsqueeze(-1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        hidden, weights = ctx.saved_tensors
        gate, up = hidden.chunk(2, dim=-1)
        with torch.enable_grad():
            gate = gate.detach().requires_grad_()
            activated = ctx.act_fn(gate)
        grad_weights = None
        if weights is not None:
            if ctx.needs_input_grad[1]:
                grad_weights = (grad * (activated.detach() * up)).sum(-1).to(ctx.weights_dtype)
            grad = grad * weights.unsqueeze(-1)
        (grad_gate,) = torch.autograd.grad(activated, gate, grad * up)
        return torch.cat([grad_gate, grad * activated.detach()], dim=-1), grad_weights, None
