"""Rows moved and summed by index without autograd keeping what their backward never reads.

Contract:

* :func:`sum_rows(rows, index, size)`: ``out [size, W]`` in ``rows.dtype`` with ``out[index[i]] += rows[i]``: the
  values and gradients of ``rows.new_zeros(size, W).index_add(0, index, rows)``, whose autograd keeps ``rows`` (torch's
  ``index_add`` keeps its source whole for its backward's ``expand_as``), a ``[pairs, hidden]`` tensor per
  mixture-of-experts layer and micro-batch that backward never reads. Kept here: the index.
* :func:`permuted_rows(rows, order)`: ``out[order[i]] = rows[i]`` (``order`` a permutation of the rows): the values and
  gradients of ``torch.empty_like(rows).index_copy(0, order, rows)``, which keeps ``rows`` whole too; this keeps the
  inverse permutation only (an ``index_select``).

No Lightning imports.
"""

from __future__ import annotations

import torch


def sum_rows(rows: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """``out[index[i]] += rows[i]`` into ``size`` zero rows (see the module docstring)."""
    return _SumRows.apply(rows, index, size)


def permuted_rows(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``out[order[i]] = rows[i]`` (see the module docstring)."""
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    return rows.index_select(0, inverse)


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index, size):  # type: ignore[override]
        ctx.save_for_backward(index)
        return rows.new_zeros((size, rows.shape[1])).index_add_(0, index, rows)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None
