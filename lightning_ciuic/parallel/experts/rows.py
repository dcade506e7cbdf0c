"""Rows moved and summed by index without autograd keeping what their backward never reads.

Contract:

* :func:`sum_rows(rows, index, size, weights=None)`: ``out [size, W]`` in ``rows.dtype`` with
  ``out[index[i]] += rows[i] * weights[i]`` (``weights``: ``[N]``, or ``None`` for 1): the values and gradients of
  ``rows.new_zeros(size, W).index_add(0, index, rows * weights[:, None])``, whose autograd keeps the weighted
  product (torch's ``index_add`` keeps its source whole for its backward's ``expand_as``), a ``[pairs, hidden]``
  tensor per mixture-of-experts layer and micro-batch that backward never reads. Kept here: ``weights`` (when
  ``rows`` needs a gradient), ``rows`` (when ``weights`` does), the index.
* :func:`permuted_rows(rows, order)`: ``out[order[i]] = rows[i]`` (``order`` a permutation of the rows): the values and
  gradients of ``torch.empty_like(rows).index_copy(0, order, rows)``, which keeps ``rows`` whole too; this keeps the
  inverse permutation only (an ``index_select``).

No Lightning imports.
"""

from __future__ import annotations

from typing import Optional

import torch


def sum_rows(rows: torch.Tensor, index: torch.Tensor, size: int, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[index[i]] += rows[i] * weights[i]`` into ``size`` zero rows (see the module docstring)."""
    return _SumRows.apply(rows, index, size, weights)


def permuted_rows(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``out[order[i]] = rows[i]`` (see the module docstring)."""
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    return rows.index_select(0, inverse)


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index, size, weights):  # type: ignore[override]
        source = rows if weights is None else rows * weights.unsqueeze(-1)
        out = rows.new_zeros((size, rows.shape[1])).index_add_(0, index, source)
        ctx.save_for_backward(
            index,
            rows if weights is not None and ctx.needs_input_grad[3] else None,
            weights if weights is not None and ctx.needs_input_grad[0] else None,
        )
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        index, rows, weights = ctx.saved_tensors
        picked = grad.index_select(0, index)
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_rows = picked if weights is None else picked * weights.unsqueeze(-1)
        if ctx.needs_input_grad[3]:
            grad_weights = (picked * rows).sum(-1)
        return grad_rows, None, None, grad_weights
