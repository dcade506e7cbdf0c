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
    grad = grad.detach().float()
    if math.isinf(norm_type):
        return grad.abs().max() if grad.numel() else grad.new_zeros(())
    return grad.abs().pow(norm_type).sum()


@torch.no_grad()
def total_grad_norm(
    parameters: Iterable[torch.nn.Parameter], norm_type: float = 2.0, pipeline_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The norm of all gradients of ``parameters`` taken together, identical on every rank."""
    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    combine = torch.maximum if is_inf else torch.add
    replicated = torch.zeros(())
    sharded_by_group: dict[dist.ProcessGroup, torch.Tensor] = {}
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            shard_dims = [i for i, pl in enumerate(grad.placements) if isinstance(pl, Shard)]
            if len(shard_dims) > 1:  # sharded over several mesh axes: rare, take the exact slow path
                replicated = combine(replicated, _local_norm_power(grad.full_tensor(), norm_type).cpu())
                continue
            local = _local_norm_power(grad.to_local(), norm_type).cpu()
            if shard_dims:
                group = grad.device_mesh.get_group(shard_dims[0])
                sharded_by_group[group] = combine(sharded_by_group.get(group, torch.zeros(())), local)
            else:
                replicated = combine(replicated, local)
        else:
            replicated = combine(replicated, _local_norm_power(grad, norm_type).cpu())
    total = replicated
    device = _collective_device()
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for group, value in sharded_by_group.items():
        value = value.to(device)
        dist.all_reduce(value, op=op, group=group)
        total = combine(total, value.cpu())
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        total = total.to(device)
        dist.all_reduce(total, op=op, group=pipeline_group)
        total = total.cpu()
    return total if is_inf else total.pow(1.0 / norm_type)


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
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        for p in parameters:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(coef)
    return total
