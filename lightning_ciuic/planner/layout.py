"""The static phase of a plan: every rank's local parameter, gradient and optimizer-state bytes, exactly.

Contract: :func:`stage_layouts` runs :func:`~lightning_ciuic.parallel.parallelize.parallelize` (the function that
trains) on torch's fake process group, once per pipeline stage, for one rank of that stage, on a model built on the
meta device: nothing is allocated, a layout of thousands of ranks is checked in one process, and a layout that does
not fit the world fails with the very error ``fit`` raises. From each parameter's global shape and placements
(DTensor's own sharding rule) it then derives the local shape of every other rank of the stage
(:class:`TensorSpec`), so the figures for each rank are exact without building each rank.

:class:`RankBytes` holds one rank's figures: parameters (elements and bytes), gradients (trainable parameters'
local shards), optimizer state (measured per value on the optimizer's own class: :class:`OptimizerStateSize`), the
data-parallel engine's buffers (the engine the strategy runs, :func:`~lightning_ciuic.comm.engines.build_engine`, set up on the meta device:
:meth:`~lightning_ciuic.comm.data_parallel.DataParallel.buffer_bytes`), and the largest FSDP2 unit the rank gathers. :func:`imbalance` names the parameters that leave some ranks
much fuller than others.

No Lightning imports.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ciuic import compat
from lightning_ciuic.config import ParallelismConfig
from lightning_ciuic.parallel.dims import ParallelDims
from lightning_ciuic.comm.engines import build_engine
from lightning_ciuic.parallel.parallelize import Parallelized, parallelize

ModuleFactory = Callable[[Any], nn.Module]  # (the mesh) -> the module, built on the meta device
OptimizerFactory = Callable[[nn.Module], Sequence[torch.optim.Optimizer]]


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group as this process's default group: ``rank`` of ``world_size``; collectives return
    at once and move nothing. ``sys.excepthook`` is left as it was: ``init_process_group`` wraps it to put
    ``[rank<r>]:`` before every line of an uncaught traceback, and a plan makes a group for each rank it builds, so
    the prefixes would pile up (``[rank1920]: [rank1792]: ...`` on every line)."""
    if dist.is_initialized():
        raise RuntimeError("plan() runs on torch's fake process group and a process group exists already: call it outside a run.")
    hook = sys.excepthook
    try:
        dist.init_process_group("fake", store=compat.fake_store(), rank=rank, world_size=world_size)
    finally:
        sys.excepthook = hook
    try:
        yield
    finally:
        dist.destroy_process_group()
        compat.forget_dtensor_meshes()


@dataclass(frozen=True)
class TensorSpec:
    """One parameter of a stage: its global shape and, for a DTensor, how it is placed on which ranks."""

    name: str
    global_shape: tuple[int, ...]
    element_size: int
    trainable: bool
    mesh_shape: tuple[int, ...] = ()
    placements: tuple[Any, ...] = ()
    coordinates: Optional[dict[int, tuple[int, ...]]] = None  # rank -> its coordinate on the parameter's mesh

    @classmethod
    def of(cls, name: str, param: torch.Tensor, coordinates: Callable[[Any], dict[int, tuple[int, ...]]]) -> "TensorSpec":
        base = dict(name=name, global_shape=tuple(param.shape), element_size=param.element_size(), trainable=param.requires_grad)
        if not isinstance(param, DTensor):
            return cls(**base)
        mesh = param.device_mesh
        return cls(**base, mesh_shape=tuple(mesh.shape), placements=tuple(param.placements), coordinates=coordinates(mesh))

    def local_numel(self, rank: int) -> int:
        if self.coordinates is None:
            return math.prod(self.global_shape)
        return math.prod(compat.local_shape(self.global_shape, self.mesh_shape, self.coordinates[rank], self.placements))


@dataclass(frozen=True)
class OptimizerStateSize:
    """Bytes of optimizer state a parameter of ``n`` values and one element size takes: ``per_value * n + fixed``,
    measured by one step of the optimizer's own class with the group's own options on a 3-value tensor."""

    per_value: int
    fixed: int

    @classmethod
    def measure(cls, optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype) -> "OptimizerStateSize":
        probe = torch.zeros(3, dtype=dtype, requires_grad=True)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        options = {k: v for k, v in group.items() if k != "params" and k in accepted}
        probe_optimizer = type(optimizer)([probe], **options)
        probe.grad = torch.ones_like(probe)
        probe_optimizer.step()
        per_value = fixed = 0
        for value in probe_optimizer.state[probe].values():
            if isinstance(value, torch.Tensor):
                if value.numel() == probe.numel():
                    per_value += value.element_size()
                else:
                    fixed += value.numel() * value.element_size()
        return cls(per_value, fixed)


@dataclass
class RankBytes:
    """One rank's exact figures (bytes unless said)."""

    parameters: int = 0  # elements
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    optimizer_bytes: int = 0
    buffer_bytes: int = 0  # the data-parallel engine's own: gradient buckets, DiLoCo's copies

    def key(self) -> tuple[int, ...]:
        return (self.parameters, self.parameter_bytes, self.gradient_bytes, self.optimizer_bytes, self.buffer_bytes)


@dataclass
class StageLayout:
    """What one rank of pipeline stage ``stage`` built, and every rank of the stage's figures derived from it."""

    stage: int
    ranks: list[int]
    tensors: list[TensorSpec]
    optimizer_sizes: dict[str, OptimizerStateSize]  # parameter name -> its state's size (absent: not optimized)
    largest_unit: tuple[str, int] = ("", 0)  # (name, bytes gathered) of the largest FSDP2 unit; ("", 0) unsharded
    engine_bytes: int = 0  # the data-parallel engine's own tensors on this stage's ranks (DataParallel.buffer_bytes)
    per_rank: dict[int, RankBytes] = field(default_factory=dict)

    def structure(self) -> tuple:
        """What two stages' first ranks share when they hold alike parts of the model: each parameter in order (its
        name with layer indices as ``*``, global shape, element size, placements), the rank's figures, the largest
        FSDP2 unit and the engine's buffers."""
        parameters = tuple(
            (re.sub(r"\d+", "*", t.name), t.global_shape, t.element_size, t.trainable, t.mesh_shape, t.placements)
            for t in self.tensors
        )
        return parameters, self.figures(self.ranks[0]).key(), self.largest_unit[1], self.engine_bytes

    def figures(self, rank: int) -> RankBytes:
        found = self.per_rank.get(rank)
        if found is None:
            found = self.per_rank[rank] = self._count(rank)
        return found

    def _count(self, rank: int) -> RankBytes:
        out = RankBytes()
        for spec in self.tensors:
            numel = spec.local_numel(rank)
            out.parameters += numel
            out.parameter_bytes += numel * spec.element_size
            if spec.trainable:
                out.gradient_bytes += numel * spec.element_size
            size = self.optimizer_sizes.get(spec.name)
            if size is not None:
                out.optimizer_bytes += size.per_value * numel + size.fixed
        out.buffer_bytes = self.engine_bytes
        return out


def stage_representatives(dims: ParallelDims) -> list[int]:
    """The lowest global rank of each pipeline stage (``pp`` is the mesh's outermost axis)."""
    per_stage = dims.world_size // dims.pp
    return [stage * per_stage for stage in range(dims.pp)]


def build_stage(
    rank: int, dims: ParallelDims, config: ParallelismConfig, build: ModuleFactory, optimizers: OptimizerFactory,
) -> StageLayout:
    """Parallelize the module for ``rank`` (inside :func:`fake_world`) and keep what every rank of its stage needs."""
    meshes = dims.build("cpu")
    mesh = meshes.world
    module = build(mesh)
    parallelized = parallelize(module, meshes, config, materialize=False)
    stage = compat.mesh_coordinates(mesh)[rank][0]
    stage_ranks = sorted(r for r, c in compat.mesh_coordinates(mesh).items() if c[0] == stage)
    cache: dict[int, dict[int, tuple[int, ...]]] = {}

    def coordinates(param_mesh: Any) -> dict[int, tuple[int, ...]]:
        key = id(param_mesh)
        if key not in cache:
            cache[key] = compat.mesh_coordinates(param_mesh)
        return cache[key]

    names = {id(p): n for n, p in module.named_parameters()}
    tensors = [TensorSpec.of(n, p, coordinates) for n, p in module.named_parameters()]
    sizes: dict[str, OptimizerStateSize] = {}
    measured: dict[tuple[int, int, torch.dtype], OptimizerStateSize] = {}
    for optimizer in optimizers(module):
        for g, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                key = (id(optimizer), g, param.dtype)
                if key not in measured:
                    measured[key] = OptimizerStateSize.measure(optimizer, group, param.dtype)
                if id(param) in names:
                    sizes[names[id(param)]] = measured[key]
    engine = build_engine(parallelized, config)  # on the meta device: its buffers' sizes, no memory
    layout = StageLayout(stage, stage_ranks, tensors, sizes, engine_bytes=engine.buffer_bytes() if engine is not None else 0)
    if engine is not None:
        engine.close()
    if parallelized.fsdp is not None:
        layout.largest_unit = largest_unit(module, parallelized, config)
    return layout


def largest_unit(module: nn.Module, parallelized: Parallelized, config: ParallelismConfig) -> tuple[str, int]:
    """The FSDP2 unit with the most bytes gathered at once (its parameters whole over the sharding ranks, in the
    compute dtype): ``(name, bytes)``."""
    assert parallelized.fsdp is not None
    names = {id(m): n or "(root)" for n, m in module.named_modules()}
    dtype = config.sharding.param_dtype
    best = ("", 0)
    for unit in parallelized.fsdp.units + parallelized.fsdp.roots:
        total = sum(
            numel * (torch.empty((), dtype=dtype).element_size() if dtype is not None else size)
            for numel, size in compat.fsdp_gathered_params(unit)
        )
        if total > best[1]:
            best = (names.get(id(unit), type(unit).__name__), total)
    return best


def imbalance(layouts: Sequence[StageLayout], threshold: float = 0.10) -> Optional[str]:
    """A warning when some rank holds more than ``threshold`` more parameter bytes than another of its stage,
    naming the parameters whose shards differ most, or ``None``."""
    worst: Optional[tuple[float, StageLayout, int, int]] = None
    for layout in layouts:
        held = {r: layout.figures(r).parameter_bytes for r in layout.ranks}
        low, high = min(held.values()), max(held.values())
        spread = (high - low) / max(low, 1)
        if spread > threshold and (worst is None or spread > worst[0]):
            worst = (spread, layout, min(held, key=held.get), max(held, key=held.get))
    if worst is None:
        return None
    spread, layout, low_rank, high_rank = worst
    uneven = []
    for spec in layout.tensors:
        counts = [spec.local_numel(r) for r in layout.ranks]
        if min(counts) != max(counts):
            holders = [r for r, c in zip(layout.ranks, counts) if c > 0]
            uneven.append((max(counts) - min(counts), spec, holders))
    uneven.sort(key=lambda item: -item[0] * item[1].element_size)
    shown = ", ".join(
        f"{spec.name} {list(spec.global_shape)} (held by {len(holders)} of {len(layout.ranks)} ranks)" for _, spec, holders in uneven[:3]
    )
    high = layout.figures(high_rank).parameter_bytes
    low = layout.figures(low_rank).parameter_bytes
    ratio = f"{high / low:.2f}x" if low else "all of it"
    shown_specs = [(spec, holders) for _, spec, holders in uneven[:3]]
    some_ranks_hold_none = any(len(holders) < len(layout.ranks) for _, holders in shown_specs)
    why = (
        "Their first dimension is smaller than the ranks sharding it (some ranks hold none of it)" if some_ranks_hold_none
        else "Their first dimension is not a multiple of the ranks sharding it (each rank holds a ceiling share of its"
        " rows, the last ranks fewer)"
    )
    remedies = ["a data_parallel_shard_size that divides it", "fewer data_parallel_shard_size ranks (HSDP)",
                "fsdp_units that keep such tensors whole"]
    if any("expert" in spec.name for spec, _ in shown_specs):
        remedies.insert(0, "shard the experts with expert_parallel_size")
    return (
        f"uneven shards: in pipeline stage {layout.stage}, rank {high_rank} holds {high} parameter bytes and rank"
        f" {low_rank} {low} ({ratio}); the parameters that differ most: {shown}{' and more' if len(uneven) > 3 else ''}."
        f" {why}: {', '.join(remedies[:-1])}, or {remedies[-1]}."
    )
