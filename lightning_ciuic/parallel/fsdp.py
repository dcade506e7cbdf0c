"""FSDP2 units: which modules ``fully_shard`` groups, sharding them, finding a user's own, and materialising meta tensors.

Contract:

* :func:`shard(module, mesh, config, stages=())`: ``mesh`` is 1-D (``dp_shard``: FSDP) or 2-D (``dp_replicate,
  dp_shard``: HSDP). ``fully_shard`` groups the parameters into units, bottom-up: :attr:`ShardingConfig.units`
  (module names as in ``named_modules()``, or module classes) or, by default, every child of the outermost
  ``nn.ModuleList`` s (a transformer's blocks), then the root. Under pipeline parallelism each of this rank's
  ``stages`` is a root (its default units: its pipeline blocks). Parameters become DTensors sharded on dim 0 over
  ``dp_shard`` (tensor-parallel DTensors gain the data-parallel axes: a 2-D mesh slice, as torchtitan does).
  :attr:`ShardingConfig.zero_stage` (:meth:`ShardingConfig.stage_of`: ``None`` is 3, or 2 under pipeline parallelism
  without ``cpu_offload``, torchtitan's default) picks what is sharded when: 3 frees a unit's gathered parameters after
  its forward (``reshard_after_forward=True``: gathered again for its backward, every micro-batch); 2 and 1 keep
  them from the first forward of an optimizer step to its last backward (``reshard_after_forward=False``, the
  engine and the pipeline stage keeping them across micro-batches); a root is never resharded after forward (its
  parameters are needed first in backward). ``param_dtype`` / ``reduce_dtype`` are
  FSDP2's ``MixedPrecisionPolicy``; ``cpu_offload`` its ``CPUOffloadPolicy``.
* :func:`gradients_held(roots)`: while inside, torch's pipeline stages of these FSDP2 roots skip their reduce after a
  schedule's last backward (:func:`holds_gradients`): under gradient accumulation, a pipelined stage's gradients are
  reduce-scattered once per optimizer step (the engine's ``no_sync``), its weights kept gathered (ZeRO-1/2).
* :func:`found_sharding(module)`: the units a user's own ``fully_shard`` calls made (in ``configure_model``, as
  for Lightning's ``ModelParallelStrategy``), or ``None``; the roots are the outermost ones.
* :class:`FSDPLayout`: the mesh, the roots and the other units (sizes: ``comm.sharded.owned_numel``).
* :func:`materialize(module, device)`: allocate meta tensors (a sharded module's: this rank's shards only) and
  initialise them.

No Lightning imports.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from lightning_ciuic import compat
from lightning_ciuic.tensors import local_tensor

if TYPE_CHECKING:
    from lightning_ciuic.parallel.experts import ExpertLayout

UnitSpec = Union[str, type]
ZERO_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class ShardingConfig:
    """How the model is cut into FSDP2 units and kept (see the module docstring)."""

    units: Optional[tuple[UnitSpec, ...]] = None
    zero_stage: Optional[int] = None  # 1, 2, 3, or None: 3, and 2 under pipeline parallelism (stage_of)
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
        if self.zero_stage not in (None, *ZERO_STAGES):
            raise ValueError(
                f"zero_stage={self.zero_stage!r}: use 1 (optimizer state sharded: weights gathered and gradients"
                " reduce-scattered once per optimizer step, gradients held whole until the end of backward), 2 (the"
                " same, gradients reduce-scattered unit by unit in the last backward), 3 (weights gathered for every"
                " forward and backward) or None (3, and 2 under pipeline parallelism)."
            )

    def stage_of(self, pipelined: bool) -> int:
        """The ZeRO stage that runs: ``zero_stage``, or by default 3, and 2 under pipeline parallelism (torchtitan's
        default: a stage's weights gathered once per step, not once per micro-batch) unless ``cpu_offload``."""
        if self.zero_stage is not None:
            return self.zero_stage
        return 2 if pipelined and not self.cpu_offload else 3


@dataclass
class FSDPLayout:
    """The FSDP2 units of a sharded module (see the module docstring)."""

    mesh: DeviceMesh
    roots: list[FSDPModule]
    units: list[FSDPModule]


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


def shard(
    module: nn.Module, mesh: DeviceMesh, config: ShardingConfig, stages: Sequence[nn.Module] = (),
    experts: Optional["ExpertLayout"] = None,
) -> FSDPLayout:
    """Apply ``fully_shard`` to the experts (each packed-experts module a unit over the ranks holding the same
    experts), the units, then the roots (see the module docstring)."""
    expert_units = _shard_experts(experts, config, pipelined=bool(stages)) if experts is not None else []
    roots = list(stages) or [module]
    if config.units is None:
        units = [unit for root in roots for unit in default_units(root)]
    else:  # named against the whole module; a pipeline rank shards those of its stages
        inside = {id(m) for root in roots for m in root.modules()}
        units = [unit for unit in select_units(module, config.units) if id(unit) in inside]
    policies = _policies(config)
    reshard_after_forward = config.stage_of(pipelined=bool(stages)) == 3
    for group, reshard in ((units, reshard_after_forward), (roots, False)):
        for unit in group:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, **policies)
    return FSDPLayout(mesh, roots, [*expert_units, *units])  # type: ignore[arg-type]


def _policies(config: ShardingConfig) -> dict:
    return dict(
        mp_policy=MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype),
        offload_policy=CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
    )


def _shard_experts(experts: "ExpertLayout", config: ShardingConfig, pipelined: bool) -> list[nn.Module]:
    """Each packed-experts module its own unit over ``experts.data_mesh`` (its parameters are ``ep`` DTensors already):
    on the experts' dim while each rank keeps at least one, else on the next."""
    mesh = experts.data_mesh
    units = list(experts.modules.values())
    for unit in units:
        local_experts = local_tensor(unit.gate_up_proj).shape[0]
        dim = 0 if local_experts >= mesh.size(mesh.ndim - 1) else 1  # the last axis shards (HSDP: the first replicates)
        fully_shard(
            unit, mesh=mesh, reshard_after_forward=config.stage_of(pipelined) == 3,
            shard_placement_fn=lambda param, dim=dim: Shard(dim), **_policies(config),
        )
    return units


_HELD: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@contextmanager
def gradients_held(roots: Sequence[nn.Module]) -> Iterator[None]:
    """See the module docstring: the roots' pipeline stages keep their gradients unreduced while inside."""
    _HELD.update(roots)
    try:
        yield
    finally:
        for root in roots:
            _HELD.discard(root)


def holds_gradients(module: nn.Module) -> bool:
    """Whether ``module`` (a pipeline stage's FSDP2 root) is inside :func:`gradients_held`."""
    return module in _HELD


def found_sharding(module: nn.Module) -> Optional[FSDPLayout]:
    """The FSDP2 units already in ``module`` (a user's ``fully_shard``), roots outermost; ``None`` if there are none."""
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        return None
    inner = {id(sub) for unit in fsdp for sub in unit.modules() if sub is not unit}
    roots = [m for m in fsdp if id(m) not in inner]
    units = [m for m in fsdp if id(m) in inner]
    meshes = {tuple(mesh.mesh.flatten().tolist()): mesh for mesh in map(compat.fsdp_mesh, fsdp) if mesh is not None}
    if len(meshes) > 1:
        raise ValueError(
            f"{type(module).__name__}'s fully_shard units use {len(meshes)} different meshes; shard every unit over"
            " the same data-parallel mesh (self.device_mesh['data_parallel'])."
        )
    if not meshes:
        raise ValueError(f"{type(module).__name__}'s fully_shard units own no parameters: nothing is sharded.")
    return FSDPLayout(next(iter(meshes.values())), roots, units)  # type: ignore[arg-type]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate a module's meta tensors on ``device`` (a sharded module's: this rank's shards) and initialise them: the
    module's ``init_weights()`` when it has one (torchtitan's convention); else each Hugging Face ``PreTrainedModel``
    in it by its own initialisation (:func:`_init_hugging_face`: rotary tables and other non-persistent buffers
    included) and every other sub-module by its ``reset_parameters()``. DTensor random ops give each shard the values
    of its part of the whole tensor, the same on every data-parallel replica. A sub-module with parameters or buffers
    that none of these initialises is an error (its values would be uninitialised memory)."""
    module.to_empty(device=device)
    init = getattr(module, "init_weights", None)
    if callable(init) and not _is_hugging_face(module):
        init()
        return
    models = _hugging_face_models(module)
    for model in models:
        _init_hugging_face(model)
    _reset_parameters(module, skip={id(sub) for model in models for sub in model.modules()})


def _is_hugging_face(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (found by its classes: transformers is optional)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__ == "transformers.modeling_utils" for c in type(module).__mro__)


def _hugging_face_models(module: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models in ``module`` (``module`` itself if it is one)."""
    if _is_hugging_face(module):
        return [module]
    return [model for child in module.children() for model in _hugging_face_models(child)]


def _init_hugging_face(model: nn.Module) -> None:
    """``model.init_weights()``, as ``from_pretrained`` initialises what it did not load: every module's
    ``_init_weights`` (norms ones, rotary ``inv_freq`` computed from the config, ...), then the tied weights tied. The
    ``_is_hf_initialized`` marks that make it skip a module are cleared first: ``to_empty`` replaced every value."""
    for sub in model.modules():
        sub.__dict__.pop("_is_hf_initialized", None)
    model.init_weights()


def _reset_parameters(module: nn.Module, skip: set[int]) -> None:
    """Every sub-module of ``module`` not in ``skip`` (ids) that owns parameters or buffers: its ``reset_parameters()``;
    those without one are named in a ``TypeError``."""
    missing = []
    for sub in module.modules():
        owns = any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False))
        if id(sub) in skip or not owns:
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
