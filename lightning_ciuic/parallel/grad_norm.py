"""Global gradient norm and clipping over a mix of plain tensors and tensor-parallel DTensors.

Contract: ``clip_grad_norm_(parameters, max_norm, norm_type=2.0)`` computes the norm of the *whole* model's
gradient, as single-process training would, and scales every gradient in place by
``min(1, max_norm / (norm + 1e-6))`` (torch's rule). It returns the total norm as a plain tensor, equal
on every rank.

Why not ``torch.nn.utils.clip_grad_norm_``: with tensor parallelism some gradients are DTensors (sharded
over the ``tp`` axis) and some plain tensors (replicated); torch refuses to mix them in one call. Here a
DTensor sharded on any mesh axis contributes the sum of its shards (one all-reduce over its mesh), a
replicated DTensor or a plain tensor contributes once. With pipeline parallelism each rank holds other
parameters: ``pipeline_group`` adds up the stages' contributions. Gradients are assumed already synchronized
over the data-parallel axis (they are equal on every ``dp`` rank). Supports finite ``norm_type`` and ``inf``.

No Lightning imports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _local_norm_power(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """This tensor's contribution (max |g| for inf, else sum |g|^p) as a float64 scalar on the gradient's device."""
    grad = grad.detach()
    if math.isinf(norm_type):
        value = grad.abs().max() if grad.numel() else grad.new_zeros(())
    else:
        value = grad.abs().pow(norm_type).sum(dtype=torch.float64)  # float64 sums: fp16/bf16/fp32 gradients alike
    return value.to(torch.float64)


@torch.no_grad()
def total_grad_norm(
    parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0, pipeline_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The norm of all gradients of ``parameters`` taken together, identical on every rank: a scalar in the
    gradients' dtype (as torch's) on the device collectives use, summed in float64 (the gradients stay where they
    are; nothing waits on the host)."""
    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    device = _collective_device()

    def combine(values: list[torch.Tensor]) -> torch.Tensor:
        if not values:
            return torch.zeros((), dtype=torch.float64, device=device)
        stacked = torch.stack([v.to(device) for v in values])
        return stacked.max() if is_inf else stacked.sum()

    replicated: list[torch.Tensor] = []
    sharded_by_group: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
    dtype = None
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        dtype = grad.dtype if dtype is None else torch.promote_types(dtype, grad.dtype)
        if isinstance(grad, DTensor):
            shard_dims = [i for i, pl in enumerate(grad.placements) if isinstance(pl, Shard)]
            if len(shard_dims) > 1:  # sharded over several mesh axes: rare, take the exact slow path
                replicated.append(_local_norm_power(grad.full_tensor(), norm_type))
            elif shard_dims:
                group = grad.device_mesh.get_group(shard_dims[0])
                sharded_by_group.setdefault(group, []).append(_local_norm_power(grad.to_local(), norm_type))
            else:
                replicated.append(_local_norm_power(grad.to_local(), norm_type))
        else:
            replicated.append(_local_norm_power(grad, norm_type))
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    parts = [combine(replicated)]
    for group, values in sharded_by_group.items():
        value = combine(values)
        dist.all_reduce(value, op=op, group=group)
        parts.append(value)
    total = combine(parts)
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        dist.all_reduce(total, op=op, group=pipeline_group)
    total = total if is_inf else total.pow(1.0 / norm_type)
    return total.to(dtype or torch.get_default_dtype())


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    pipeline_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip gradients in place to a global norm of ``max_norm``; returns the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(parameters, norm_type, pipeline_group)
    coef = float(max_norm) / (float(total) + 1e-6)  # the one host sync of clipping
    if coef < 1.0:
        for p in parameters:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(coef)
    return total
