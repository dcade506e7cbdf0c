"""HybridParallelStrategy's collectives for Lightning (``reduce``, ``broadcast``): over every rank unless a group is
given, and no-ops where no process group exists.

Contract: :func:`reduce(tensor, group, reduce_op)` returns a new tensor (the input is left as it was): ``"sum"``,
``"mean"`` / ``"avg"`` (integers averaged as float32), ``"max"``, ``"min"`` (names or ``ReduceOp`` members); another
op is a ``ValueError`` naming the ones that work; a non-tensor is returned as it is. :func:`broadcast(obj, src)`
returns ``src`` 's object on every rank. :func:`barrier(device)` waits for every rank; on NCCL it names the device
this rank uses (else NCCL guesses, and may hang).

No Lightning imports.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_ciuic.parallel.tensor import local_loss

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def reduce(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
    tensor = local_loss(tensor)  # a DTensor (a loss logged from vocabulary-sharded logits): its whole value
    if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
        return tensor
    op_name = "mean" if reduce_op is None else getattr(reduce_op, "name", str(reduce_op)).split(".")[-1].lower()
    if op_name not in REDUCE_OPS:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported; use one of {sorted(REDUCE_OPS)}.")
    result = tensor.detach().clone()
    if op_name in ("mean", "avg") and not result.is_floating_point():
        result = result.float()
    dist.all_reduce(result, op=REDUCE_OPS[op_name], group=group)
    if op_name in ("mean", "avg"):
        result = result / dist.get_world_size(group)
    return result


def broadcast(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(device: torch.device) -> None:
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
