"""Sharded: data parallelism that shards the model (torch's FSDP2, ``fully_shard``) over ``dp_shard``, with
replicas of the shards over ``dp_replicate`` (HSDP).

Contract (a :class:`~lightning_ciuic.comm.data_parallel.DataParallel` engine):

* ``setup(module, mesh, stages=())``: ``mesh`` is 1-D (``dp_shard``: FSDP) or 2-D (``dp_replicate, dp_shard``:
  HSDP). Every rank first takes the weights of the mesh's first rank (as DDP does). Then ``fully_shard`` groups
  the parameters into units, bottom-up: :attr:`ShardingConfig.units` (module names as in ``named_modules()``, or
  module classes) or, by default, every child of the outermost ``nn.ModuleList`` s (a transformer's blocks), then
  the root. Under pipeline parallelism each of this rank's ``stages`` is a root (its default units: its pipeline
  blocks), so torch's schedule, which calls the stages directly, sees FSDP modules: it accumulates the
  micro-batches' gradients unreduced and reduce-scatters them once, after the last. A module built on the meta
  device is sharded first and then materialised shard by shard (:func:`materialize`): no rank ever holds it whole. Parameters become DTensors sharded on dim 0 over ``dp_shard`` (tensor-parallel DTensors
  gain the data-parallel axes: a 2-D mesh slice, as torchtitan does). A unit's parameters are all-gathered before
  its forward and, with ``reshard_after_forward=True`` (ZeRO-3), freed after it and gathered again for its
  backward; ``False`` keeps them until backward (ZeRO-2's memory and traffic). Its gradients are reduce-scattered,
  averaged, during backward (and all-reduced over ``dp_replicate``). Build the optimizer after set-up: it holds
  state for the shards only.
* Mixed precision (FSDP2's ``MixedPrecisionPolicy``): ``param_dtype`` is what the all-gather and the compute use,
  ``reduce_dtype`` what the gradient reduce-scatter uses (``fp16``/``bf16`` communication compression sets it);
  ``cpu_offload`` keeps shards, gradients and optimizer state in host memory.
* Every unit's all-gather and reduce-scatter run through :mod:`~lightning_ciuic.comm.fsdp_comms` (FSDP2's
  custom collectives): timed (``stats.gather_seconds`` / ``scatter_seconds``, both also in ``comm_seconds``) and
  their bytes counted as they run (pipeline micro-batches' re-gathers included). ``gradient_codec="int8"`` (or
  ``"nf4"``) makes the reduce-scatter a quantized all-to-all (ZeRO++'s qgZ), with ``error_feedback``;
  ``weight_codec="int8"`` quantizes the all-gather (qwZ).
* ``no_sync()``: FSDP2's ``set_requires_gradient_sync(False)``: gradients accumulate unreduced (and unsharded)
  until the last micro-batch, whose backward reduce-scatters the sum.
* ``after_backward()``: nothing to wait for: FSDP2 waits for its reduce-scatters at the end of backward. It adds
  the bytes of FSDP2's own all-reduce over ``dp_replicate`` (HSDP), computed for a ring (2 (r-1)/r of the gradient
  shard), not measured, and not timed.
* ``state_dict()``: the quantized reduce-scatters' error-feedback residuals (per rank, saved with checkpoints and
  snapshots like the replicated engine's).

No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_ciuic.comm.codecs import dense_codec
from lightning_ciuic.comm.data_parallel import DataParallel, broadcast_from_first
from lightning_ciuic.comm.fsdp_comms import AllGatherComm, ReduceScatterComm
from lightning_ciuic.comm.grad_sync import SyncStats
from lightning_ciuic.comm.timing import DeviceClock

UnitSpec = Union[str, type]


@dataclass(frozen=True)
class ShardingConfig:
    """How :class:`Sharded` cuts and keeps the model (see the module docstring)."""

    units: Optional[tuple[UnitSpec, ...]] = None
    reshard_after_forward: bool = True
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    cpu_offload: bool = False
    gradient_codec: Optional[str] = None  # "int8" / "nf4": the reduce-scatter as a quantized all-to-all (qgZ)
    error_feedback: bool = True
    weight_codec: Optional[str] = None  # "int8": the parameter all-gather quantized (qwZ)

    def __post_init__(self) -> None:
        if self.units is not None:
            bad = [u for u in self.units if not isinstance(u, (str, type))]
            if bad or not self.units:
                raise ValueError(
                    f"fsdp_units must be a non-empty list of module names (as in named_modules()) or module classes,"
                    f" got {list(self.units)!r}."
                )


def check_offload(cpu_offload: bool, device_type: str) -> None:
    """CPU offload is for accelerators: FSDP2's needs one, and on the CPU the shards are in host memory already."""
    if cpu_offload and device_type == "cpu":
        raise ValueError(
            "fsdp_cpu_offload=True keeps shards in host memory between a GPU's uses of them; this run computes on"
            " the CPU, where they are in host memory already (and FSDP2's offload needs an accelerator): leave"
            " fsdp_cpu_offload=False."
        )


def default_units(module: nn.Module) -> list[nn.Module]:
    """Every child of the outermost ``nn.ModuleList`` s inside ``module`` (a transformer's blocks)."""
    units: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, nn.ModuleList):
                units.extend(child)
            else:
                visit(child)

    visit(module)
    return units


def select_units(module: nn.Module, units: Optional[Sequence[UnitSpec]]) -> list[nn.Module]:
    """The modules ``fully_shard`` groups, outermost first never nested in another one already chosen (the root
    excluded: it is always the last unit)."""
    if units is None:
        return default_units(module)
    named = dict(module.named_modules())
    chosen: list[nn.Module] = []
    for spec in units:
        if isinstance(spec, str):
            if spec not in named or spec == "":
                close = [name for name in named if name and name.split(".")[-1] == spec.split(".")[-1]][:5]
                raise ValueError(
                    f"fsdp_units names {spec!r}, which is not a sub-module of {type(module).__name__};"
                    f" names look like {close or [n for n in named if n][:5]} (see model.named_modules())."
                )
            found = [named[spec]]
        else:
            found = [m for name, m in named.items() if name and isinstance(m, spec)]
            if not found:
                raise ValueError(f"fsdp_units names the class {spec.__name__}, but {type(module).__name__} has no such sub-module.")
        chosen.extend(m for m in found if all(m is not c for c in chosen))
    inside = {id(sub) for unit in chosen for sub in unit.modules() if sub is not unit}
    return [unit for unit in chosen if id(unit) not in inside]


def _numel(unit: nn.Module, skip: set[int]) -> int:
    return sum(p.numel() for p in unit.parameters() if id(p) not in skip)


class Sharded(DataParallel):
    """Parameters, gradients and optimizer state sharded over ``dp_shard`` (FSDP2); see the module docstring."""

    def __init__(self, config: ShardingConfig = ShardingConfig()) -> None:
        self.config = config
        self.mesh: Optional[DeviceMesh] = None
        self.module: Optional[nn.Module] = None
        self.roots: list[FSDPModule] = []  # the module, or under pipeline parallelism each stage this rank runs
        self.units: list[nn.Module] = []
        self._stats = SyncStats()
        self._sync = True
        self._unit_numel: list[int] = []  # parameters of each unit, the roots' own last (gathered sizes)
        self._replica_bytes = 0
        self.gradient_comms: list[ReduceScatterComm] = []  # one per unit, the roots' last

    def setup(self, module: nn.Module, mesh: DeviceMesh, stages: Sequence[nn.Module] = ()) -> None:
        check_offload(self.config.cpu_offload, mesh.device_type)
        self.close()
        self.mesh, self.group = mesh, mesh.get_group(mesh.ndim - 1)
        broadcast_from_first(module, mesh)
        roots = list(stages) or [module]
        if self.config.units is None:
            units = [unit for root in roots for unit in default_units(root)]
        else:  # named against the whole module; a pipeline rank shards those of its stages
            inside = {id(m) for root in roots for m in root.modules()}
            units = [unit for unit in select_units(module, self.config.units) if id(unit) in inside]
        mp_policy = MixedPrecisionPolicy(param_dtype=self.config.param_dtype, reduce_dtype=self.config.reduce_dtype)
        offload = CPUOffloadPolicy() if self.config.cpu_offload else OffloadPolicy()
        counted: set[int] = set()
        self._unit_numel = []
        for unit in units:
            self._unit_numel.append(_numel(unit, counted))
            counted.update(id(p) for p in unit.parameters())
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.config.reshard_after_forward, mp_policy=mp_policy, offload_policy=offload)
        for root in roots:
            self._unit_numel.append(_numel(root, counted))
            counted.update(id(p) for p in root.parameters())
            # A root's parameters are needed first in backward: never resharded after forward (FSDP2's default).
            fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload)
        self.module, self.roots, self.units = module, roots, units  # type: ignore[assignment]
        clock = DeviceClock(_device_of(mesh))
        gradient_codec = dense_codec(self.config.gradient_codec) if self.config.gradient_codec else None
        gather = AllGatherComm(self._stats, clock, dense_codec(self.config.weight_codec) if self.config.weight_codec else None)
        for unit in (*units, *roots):
            scatter = ReduceScatterComm(self._stats, clock, gradient_codec, self.config.error_feedback)
            unit.set_custom_reduce_scatter(scatter)  # type: ignore[operator]
            unit.set_custom_all_gather(gather)  # type: ignore[operator]
            self.gradient_comms.append(scatter)
        if has_meta_tensors(module):
            materialize(module, _device_of(mesh))
        self._replica_bytes = self._replica_traffic()  # derived once: the units and dtypes do not change

    def before_step(self, global_step: int) -> list[str]:
        return []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        for root in self.roots:
            root.set_requires_gradient_sync(False)
        self._sync = False
        try:
            yield
        finally:
            for root in self.roots:
                root.set_requires_gradient_sync(True)
            self._sync = True

    def after_backward(self, accumulated: bool = False) -> None:
        if self._sync:
            self._stats.bytes_sent += self._replica_bytes
            self._stats.bytes_reduced += sum(self._unit_numel) * 4

    def _replica_traffic(self) -> int:
        """Bytes this rank sends per synchronized backward in FSDP2's own all-reduce over ``dp_replicate`` (HSDP; a
        ring: 2 (r-1)/r of its gradient shard). The gathers and reduce-scatters count themselves (fsdp_comms)."""
        assert self.mesh is not None
        if self.mesh.ndim == 1:
            return 0
        shard, replicate = self.mesh.size(1), self.mesh.size(0)
        reduce_bytes = (self.config.reduce_dtype or self.config.param_dtype or _param_dtype(self.module)).itemsize
        return int(2 * (sum(self._unit_numel) / shard) * reduce_bytes * (replicate - 1) / replicate)

    @property
    def stats(self) -> SyncStats:
        return self._stats

    def payload(self) -> tuple[int, int]:
        return sum(self._unit_numel), len(self._unit_numel)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals of the quantized reduce-scatters (``gradient_codec``), by unit."""
        return {f"reduce_scatter.{i}": c.residual for i, c in enumerate(self.gradient_comms) if c.residual is not None}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, comm in enumerate(self.gradient_comms):
            comm.residual = state.get(f"reduce_scatter.{i}")

    def close(self) -> None:
        self.module, self.roots, self.units, self.mesh, self.gradient_comms = None, [], [], None, []


def _device_of(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh`` (CUDA-like meshes: the current device, as FSDP2 uses)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _param_dtype(module: Optional[nn.Module]) -> torch.dtype:
    assert module is not None
    return next((p.dtype for p in module.parameters()), torch.float32)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate a module's meta tensors on ``device`` (a sharded module's: this rank's shards) and initialise them: the
    module's ``init_weights()`` when it has one (torchtitan's convention), else every sub-module's
    ``reset_parameters()``. DTensor random ops give each shard the values of its part of the whole tensor, the same
    on every data-parallel replica. A sub-module with parameters or buffers and neither method is an error (its
    values would be uninitialised memory)."""
    module.to_empty(device=device)
    init = getattr(module, "init_weights", None)
    if callable(init):
        init()
        return
    missing = []
    for sub in module.modules():
        owns = any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False))
        if not owns:
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            missing.append(type(sub).__name__)
    if missing:
        raise TypeError(
            f"{type(module).__name__} was built on the meta device, but {sorted(set(missing))} own parameters or"
            " buffers and have no reset_parameters(): their values would be uninitialised memory. Give the model an"
            " init_weights() (or those modules reset_parameters()), or build it without empty_init."
        )
