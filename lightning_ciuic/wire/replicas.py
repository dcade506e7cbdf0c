"""The replicas' start: every data-parallel rank takes the first one's weights, as torch DDP's replicas do.

Contract: :func:`broadcast_from_first(module, mesh)` broadcasts every parameter and buffer of ``module`` (a DTensor's
local shard; meta tensors skipped) from the first rank of ``mesh``, a one-dimensional mesh of the data-parallel
ranks (``mesh["dp"]``), to the others; nothing is sent when the mesh has one rank. Used by
:func:`~lightning_ciuic.parallel.parallelize.parallelize` before it shards, and by the data-parallel engines of
:mod:`~lightning_ciuic.comm` at their set-up. No Lightning imports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic.tensors import local_tensor


@torch.no_grad()
def broadcast_from_first(module: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Every rank of ``mesh`` takes the first rank's parameters and buffers (not meta ones)."""
    if mesh.ndim != 1:
        raise ValueError(
            f"broadcast_from_first takes the data-parallel ranks as a one-dimensional mesh, got axes"
            f" {mesh.mesh_dim_names}: pass mesh['dp']."
        )
    group = mesh.get_group()
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            dist.broadcast(local_tensor(tensor).data, src=src, group=group)
