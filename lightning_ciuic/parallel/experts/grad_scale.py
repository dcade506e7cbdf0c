"""The experts' gradient scale under expert parallelism.

Contract: an expert's gradient on its rank sums the contributions of every token its ``ep`` group routed to it, i.e.
of ``dims.ep_data_ranks`` data-parallel ranks' batches. The forward scales it by :func:`expert_grad_scale`
(``1/ep_data_ranks``) on its way to the parameter (:class:`ScaleGradient`, applied to the local experts' weights in
:func:`~lightning_ciuic.parallel.experts.gemm.run_local_experts`), so the engines' mean over the ranks that hold the
same experts (``edp``, and ``dp_replicate``: :attr:`ExpertLayout.data_mesh
<lightning_ciuic.parallel.experts.layout.ExpertLayout.data_mesh>`) makes it the mean over all data-parallel ranks, as
a dense gradient is.

No Lightning imports.
"""

from __future__ import annotations

import torch

from lightning_ciuic.parallel.dims import ParallelDims


def expert_grad_scale(dims: ParallelDims) -> float:
    """``1 / dims.ep_data_ranks``: the factor the experts' gradients are scaled by (see the module docstring)."""
    return 1.0 / dims.ep_data_ranks


class ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.scale, None
