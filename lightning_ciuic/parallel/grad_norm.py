"""Global gradient norm and clipping over a mix of plain tensors and tensor-parallel DTensors.

Contract: ``clip_grad_norm_(parameters, max_norm, norm_type=2.0)`` computes the norm of the *whole* model's
gradient, as single-process training would, and scales every gradient in place by
``min(1, max_norm / (norm + 1e-6))`` (torch's rule). It returns the total norm as a plain tensor, equal
on every rank.

Why not ``torch.nn.utils.clip_grad_norm_``: with tensor parallelism some gradients are DTensors (sharded
over the ``tp`` axis) and some plain tensors (replicated); torch refuses to mix them in one call. Here a
DTensor sharded on mesh axes contributes the sum of its shards (one all-reduce per sharded axis: FSDP x TP
gradients are sharded on two), a replicated DTensor or a plain tensor contributes once, a ``Partial`` one (each rank's
unreduced share) the norm of its sum. With pipeline parallelism
each rank holds other parameters: ``pipeline_group`` adds up the stages' contributions. Gradients are assumed
already synchronized over the data-parallel axis (equal on every ``dp`` rank, or reduce-scattered over it by
FSDP). Supports finite ``norm_type`` and ``inf``.

No Lightning imports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lightning_ciuic.tensors import local_tensor


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

    # By the groups of the mesh axes a gradient is sharded over (none: replicated or a plain tensor). Reducing
    # over each axis's group in turn sums (or maxes) over all shards: FSDP x TP gradients are sharded on two axes.
    by_groups: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = {}
    dtype = None
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        dtype = grad.dtype if dtype is None else torch.promote_types(dtype, grad.dtype)
        groups: tuple[dist.ProcessGroup, ...] = ()
        if isinstance(grad, DTensor):
            if any(pl.is_partial() for pl in grad.placements):  # unreduced shares (a hook did not run): sum them first
                grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in grad.placements])
            # Every axis that is not Replicate holds a part: Shard, and FSDP2's _StridedShard (FSDP x TP on one
            # dim), which is not a Shard subclass and says is_shard() == False in torch 2.13.
            groups = tuple(grad.device_mesh.get_group(i) for i, pl in enumerate(grad.placements) if not pl.is_replicate())
        by_groups.setdefault(groups, []).append(_local_norm_power(local_tensor(grad), norm_type))
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    parts = []
    for groups, values in by_groups.items():
        value = combine(values)
        for group in groups:
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
            local_tensor(p.grad).mul_(coef)
    return total
