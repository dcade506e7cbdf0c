"""Bytes each collective of a training step sends, per mesh axis: counted from the ops themselves.

Contract: inside :class:`CollectiveTraffic` (a ``TorchDispatchMode``), every ``c10d`` and ``_c10d_functional``
collective that runs (FSDP2's gathers and reduce-scatters, the replicated engine's all-reduces, DTensor's tensor
parallel collectives, the expert dispatch's all-to-all, point-to-point sends) adds the bytes this rank sends to
``traffic.bytes[axis][collective]``. The axis is the name ``DeviceMesh`` gives the group (``mesh_tp`` -> ``tp``,
``mesh_dp_shard``, ``mesh_ep``...; Lightning's aliases ``data_parallel`` and ``tensor_parallel`` as ``dp`` and ``tp``;
an axis that spans the whole world runs on the default group: named from the step's mesh; a group made by hand: its
own description). The same mode counts a step on fake
tensors (the planner's step phase) and on real ones (the test that holds the planner to real runs), so the two are
compared op for op.

Bytes sent per rank, counted as the pack's own engines count theirs (``comm.collectives``, ``comm.fsdp_comms``):
a ring all-reduce of ``n`` bytes over ``w`` ranks sends ``2 (w-1) n / w``; an all-gather of an ``n``-byte shard and a
reduce-scatter to an ``n``-byte shard ``(w-1) n``; an all-to-all what it sends to the other ranks (its input less
its own split); a broadcast ``n`` (a chain); a send ``n``; a receive nothing. Collectives it does not know (gather,
scatter, reduce) are counted under their own name at their input's size, never dropped. Waits and barriers carry no
payload. ``traffic.calls[axis][collective]`` counts the calls (for the step estimate's per-collective latency).
``traffic.ranks[axis]`` keeps the global ranks of the first group seen on each axis (which links it crosses).

No Lightning imports.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_ciuic import compat
from lightning_ciuic.parallel.axes import MESH_ALIASES

_NO_PAYLOAD = {"wait_tensor", "barrier", "monitored_barrier_", "check_for_nan", "recv_", "recv_any_source_", "irecv"}


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor or of nested lists of them."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


def _ring_all_reduce(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


def _all_to_all(group: dist.ProcessGroup, total: int, input_splits: Optional[list[int]], rows: int) -> int:
    """What an all-to-all of ``total`` input bytes sends to the others: all but this rank's own split."""
    world = group.size()
    if not input_splits:
        return total * (world - 1) // world
    own = input_splits[group.rank()]
    return total - (total * own // rows if rows else 0)


# op name -> (the bytes it sends, given (args, group)); args as the op receives them.
_Rule = Callable[[tuple, dist.ProcessGroup], int]
_RULES: dict[str, tuple[str, _Rule]] = {
    # c10d (torch.distributed's eager collectives)
    "allreduce_": ("all_reduce", lambda a, g: _ring_all_reduce(_nbytes(a[0]), g.size())),
    "allreduce_coalesced_": ("all_reduce", lambda a, g: _ring_all_reduce(_nbytes(a[0]), g.size())),
    "_allgather_base_": ("all_gather", lambda a, g: (g.size() - 1) * _nbytes(a[1])),
    "allgather_": ("all_gather", lambda a, g: (g.size() - 1) * _nbytes(a[1])),
    "allgather_coalesced_": ("all_gather", lambda a, g: (g.size() - 1) * _nbytes(a[1])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a, g: (g.size() - 1) * _nbytes(a[1])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a, g: (g.size() - 1) * _nbytes(a[0])),
    "reduce_scatter_": ("reduce_scatter", lambda a, g: (g.size() - 1) * _nbytes(a[0])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a, g: (g.size() - 1) * _nbytes(a[0])),
    "alltoall_base_": ("all_to_all", lambda a, g: _all_to_all(g, _nbytes(a[1]), a[4], a[1].shape[0] if a[1].dim() else 0)),
    "alltoall_": ("all_to_all", lambda a, g: _nbytes(a[1]) - _nbytes(a[1][g.rank()])),
    "broadcast_": ("broadcast", lambda a, g: _nbytes(a[0])),
    "send": ("send", lambda a, g: _nbytes(a[0])),
    # _c10d_functional (DTensor, functional collectives; the group by name)
    "all_reduce": ("all_reduce", lambda a, g: _ring_all_reduce(_nbytes(a[0]), g.size())),
    "all_reduce_": ("all_reduce", lambda a, g: _ring_all_reduce(_nbytes(a[0]), g.size())),
    "all_reduce_coalesced": ("all_reduce", lambda a, g: _ring_all_reduce(_nbytes(a[0]), g.size())),
    "all_reduce_coalesced_": ("all_reduce", lambda a, g: _ring_all_reduce(_nbytes(a[0]), g.size())),
    "all_gather_into_tensor": ("all_gather", lambda a, g: (g.size() - 1) * _nbytes(a[0])),
    "all_gather_into_tensor_out": ("all_gather", lambda a, g: (g.size() - 1) * _nbytes(a[0])),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a, g: (g.size() - 1) * _nbytes(a[0])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, g: (g.size() - 1) * _nbytes(a[0]) // g.size()),
    "reduce_scatter_tensor_out": ("reduce_scatter", lambda a, g: (g.size() - 1) * _nbytes(a[0]) // g.size()),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a, g: (g.size() - 1) * _nbytes(a[0]) // g.size()),
    "all_to_all_single": ("all_to_all", lambda a, g: _all_to_all(g, _nbytes(a[0]), list(a[2]), a[0].shape[0] if a[0].dim() else 0)),
    "broadcast": ("broadcast", lambda a, g: _nbytes(a[0])),
    "isend": ("send", lambda a, g: _nbytes(a[0])),
}


def _group(args: Iterable[Any], functional: bool) -> Optional[dist.ProcessGroup]:
    """The op's process group: a boxed ``ProcessGroup`` (c10d) or a registered group's name (functional)."""
    for arg in args:
        if functional and isinstance(arg, str):
            try:
                return compat.resolve_process_group(arg)
            except (RuntimeError, ValueError):
                continue  # a reduce op's name ("sum"), not a group
        if not functional and isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except RuntimeError:
                continue  # a boxed ReduceOp
    return None


def axis_of(group: dist.ProcessGroup, world_axis: str) -> str:
    """The mesh axis a group spans: ``DeviceMesh`` describes its groups as ``mesh_<axis>``, and an axis spanning the
    whole world is the default group itself (``world_axis``); a group made by hand: its description."""
    if group.group_name == dist.group.WORLD.group_name:
        return world_axis
    description = getattr(group, "group_desc", "") or f"group {group.group_name}"
    axis = description.removeprefix("mesh_")
    return str(MESH_ALIASES.get(axis, axis))  # Lightning's names for the same axes: one name each


def world_axis_of(mesh: Optional[DeviceMesh]) -> str:
    """The name of what the default group spans on ``mesh``: its axes of more than one rank (``dp``,
    ``dp_shard x tp``), or ``world`` without a mesh."""
    if mesh is None:
        return "world"
    names = [name for name, size in zip(mesh.mesh_dim_names or (), mesh.shape) if size > 1]
    return " x ".join(names) or "world"


class CollectiveTraffic(compat.TorchDispatchMode):
    """Counts the bytes this rank's collectives send, per axis and collective (see the module docstring)."""

    def __init__(self, mesh: Optional[DeviceMesh] = None) -> None:
        super().__init__()
        self.world_axis = world_axis_of(mesh)
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.ranks: dict[str, list[int]] = {}

    def per_axis(self) -> dict[str, int]:
        return {axis: sum(by_collective.values()) for axis, by_collective in sorted(self.bytes.items())}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            name = compat.overload_packet(func).__name__
            if name not in _NO_PAYLOAD:
                group = _group([*args, *kwargs.values()], functional=namespace == "_c10d_functional")
                if group is not None:
                    collective, rule = _RULES.get(name, (name, lambda a, g: _nbytes(a[0])))
                    axis = axis_of(group, self.world_axis)
                    self.bytes[axis][collective] += int(rule(args, group))
                    self.calls[axis][collective] += 1
                    if axis not in self.ranks:
                        self.ranks[axis] = sorted(dist.get_process_group_ranks(group))
        return func(*args, **kwargs)
