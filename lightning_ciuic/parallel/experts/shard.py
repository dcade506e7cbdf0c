"""Experts sharded over ``ep``: the one entry point of expert parallelism.

Contract: :func:`shard_experts(module, meshes, dispatch, mode, devices_per_node, node_limit, overlap, input_storage)`: every packed-experts module's two parameters become
DTensors ``Shard(0)`` over ``ep`` (global shapes: DCP checkpoints and Hugging Face loading keep working), rank ``j``
holding experts ``[j E/ep, (j+1) E/ep)``, and its forward becomes
:func:`~lightning_ciuic.parallel.experts.forward.expert_parallel_forward`. First, before any module is changed, each
must have ``E % ep == 0`` and a forward known to compute what the expert-parallel one computes
(:func:`~lightning_ciuic.parallel.experts.takeover.check_takeover`); any other is refused, naming it and the form that
works; a module with no packed experts and ``ep > 1`` likewise. Returns an
:class:`~lightning_ciuic.parallel.experts.layout.ExpertLayout` (``None`` if ``dims.ep == 1``); applying it twice
changes nothing. ``mode`` ``"flat"`` or ``"hierarchical"`` and the ep ranks' nodes (``devices_per_node``: node of a
global rank ``rank // devices_per_node``; ``None``: one node) are the layout's (:class:`ExpertLayout`: the hierarchical
dispatch refused where the ep group sits on one node or its nodes do not align); where a router of ``module`` limits
its tokens to some expert groups and the nodes do not hold whole groups, it is said once (a warning on global rank 0:
what was given, how many nodes a token may reach, what works); ``node_limit`` (opt-in, a model without groups):
its routers limited to that many nodes (:func:`~lightning_ciuic.parallel.experts.nodes.limit_nodes`); ``overlap``:
each call's tokens in two chunks, one's all-to-alls in flight while the other computes (the layout's ``overlap``);
``input_storage``: the experts' input rows kept for backward in that codec's encoding (the layout's). The caller makes the data-parallel replicas equal first: each rank keeps its experts' rows of its
own copy, without communication.

No Lightning imports.
"""

from __future__ import annotations

import types
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_ciuic.parallel.dims import Meshes
from lightning_ciuic.parallel.experts.forward import LAYOUT_ATTRIBUTE, expert_parallel_forward
from lightning_ciuic.parallel.experts.layout import DispatchCompression, DispatchMode, ExpertLayout, packed_experts
from lightning_ciuic.parallel.experts.nodes import group_alignment, limit_nodes
from lightning_ciuic.parallel.experts.nodes import node_limit as routers_node_limit
from lightning_ciuic.parallel.experts.takeover import FORM, check_takeover


def shard_experts(
    module: nn.Module, meshes: Meshes, dispatch: DispatchCompression = "none", mode: DispatchMode = "flat",
    devices_per_node: Optional[int] = None, node_limit: Optional[int] = None, overlap: bool = False,
    input_storage: DispatchCompression = "none",
) -> Optional[ExpertLayout]:
    """Shard every packed-experts module of ``module`` over ``ep`` (see the module docstring). The caller makes the
    data-parallel replicas equal first: each rank keeps its experts' rows of its own copy."""
    dims = meshes.dims
    if not dims.ep_enabled:
        return None
    found = packed_experts(module)
    if not found:
        raise ValueError(
            f"expert_parallel_size={dims.ep}, but {type(module).__name__} has no packed mixture-of-experts module."
            f" {FORM}. Give its experts that form, or use expert_parallel_size=1."
        )
    existing = getattr(found[0][1], LAYOUT_ATTRIBUTE, None)
    if existing is not None:
        return existing  # applied already (Lightning sets a model up for each of fit, validate, test)
    verdicts: dict = {}  # a model's layers of one class and shape are checked once
    for name, experts in found:  # every module checked before any is changed
        _check_divisible(name, experts, dims.ep)
        check_takeover(name, experts, verdicts)
    layout = ExpertLayout(meshes, dict(found), dispatch, mode, devices_per_node, overlap=overlap, input_storage=input_storage)
    n_experts = found[0][1].gate_up_proj.shape[0]
    if node_limit is not None:  # opt-in: the routers' maths changes, one group per node
        limit_nodes(module, [name for name, _ in found], layout.nodes, node_limit)
    _say_group_alignment(module, n_experts, layout)
    layout.node_limit = routers_node_limit(module, n_experts, layout.nodes)
    ep_mesh = layout.ep_mesh
    for name, experts in found:
        for attr in ("gate_up_proj", "down_proj"):
            param = getattr(experts, attr)
            setattr(experts, attr, nn.Parameter(_shard_rows(param.data, ep_mesh), requires_grad=param.requires_grad))
        setattr(experts, LAYOUT_ATTRIBUTE, layout)
        experts.forward = types.MethodType(expert_parallel_forward, experts)
    return layout


def _say_group_alignment(module: nn.Module, n_experts: int, layout: ExpertLayout) -> None:
    """Said once (global rank 0) where a router's expert groups are not whole on the nodes (:func:`group_alignment`)."""
    why = group_alignment(module, n_experts, layout.nodes)
    if why is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"expert parallelism: {why}.", stacklevel=3)


def _check_divisible(name: str, experts: nn.Module, ep: int) -> None:
    n = experts.gate_up_proj.shape[0]
    if n % ep:
        raise ValueError(
            f"{name} has {n} experts, which expert_parallel_size={ep} does not divide: use one of"
            f" {[d for d in range(1, n + 1) if n % d == 0]}."
        )


def _shard_rows(tensor: torch.Tensor, ep_mesh: DeviceMesh) -> DTensor:
    """``Shard(0)`` over ``ep_mesh`` without communication: every rank holds the whole tensor (or a meta one)."""
    if tensor.is_meta:
        rows = tensor.shape[0] // ep_mesh.size()
        local = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
        return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
    return distribute_tensor(tensor, ep_mesh, [Shard(0)], src_data_rank=None)
