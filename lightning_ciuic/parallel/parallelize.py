"""parallelize(): the one function that turns a model into this rank's part of a parallel layout.

Contract: ``parallelize(module, layout, options, *, materialize=True)`` works in place on ``module`` (any
``nn.Module``: a LightningModule, a Hugging Face model, a bare transformer) and returns a :class:`Parallelized`.
It needs a process group (gloo, NCCL, or torch's fake one: a planner checks a layout of 1024 ranks in one process)
and no Trainer. ``layout`` is the layout's :class:`~lightning_ciuic.parallel.dims.Meshes` (or its
:class:`~lightning_ciuic.parallel.dims.ParallelDims`, whose meshes are then built on the default device);
``options`` anything with the attributes of :class:`ParallelizeOptions` (``lightning_ciuic.config.ParallelismConfig``
is one: this module does not import it, the arrow runs from the config to ``parallel/``). In order:

1. **Tensor parallel** over ``tp``: the plan of the module's ``tensor_parallel_plan(tp_mesh)`` (names relative to
   the module; the method may keep ``tp_mesh`` for its own collectives; one that takes a ``sequence_parallel``
   keyword is given ``options.sequence_parallel`` (under pipeline parallelism too: stages hand each other
   their tp rank's part of the sequence), and its plan then shards the residual stream on the sequence and keeps the
   logits vocabulary-sharded), else a Hugging Face ``_tp_plan`` translated
   (:func:`~lightning_ciuic.parallel.tensor.hugging_face_plan`).
   ``Parallelized.loss_parallel`` says whether the module's logits come out vocabulary-sharded: the caller computes
   their loss, forward and backward, inside
   :func:`~lightning_ciuic.parallel.tensor.loss_parallel_context`. A module whose parameters are already
   DTensors (its own ``parallelize_module`` in ``configure_model``) is left as it is. ``tp > 1`` with no plan and
   nothing sharded is an error: every tp rank would compute the same thing. Either way, unless FSDP2 shards the
   module, each DTensor parameter's gradient is kept in its parameter's placements
   (:func:`~lightning_ciuic.parallel.tensor.gradients_in_parameter_placements`).
2. **Expert parallel** over ``ep`` (``dims.ep > 1``): every data-parallel rank first takes the first one's weights,
   then every packed-experts module is sharded expert-wise over ``ep`` and dispatches its tokens
   (:func:`~lightning_ciuic.parallel.experts.shard_experts`); ``Parallelized.experts`` is its layout, which the
   data-parallel engine reads (expert gradients are averaged over the ranks holding the same experts). Sharded,
   each experts module becomes its own FSDP2 unit over those ranks (step 5).
3. **FP8 GEMMs** (``options.gemm_precision == "fp8"``): every ``nn.Linear`` of the blocks below (not the routers)
   multiplies in FP8, and so do the expert-parallel experts (:mod:`~lightning_ciuic.parallel.fp8`); then
   **activation recomputation** (``options.gradient_checkpointing``, a
   :class:`~lightning_ciuic.parallel.recompute.Recompute`: full, every k-th block, torchtitan's op-level selective
   policy, or named sub-modules such as DeepSeek-V3's norms and MLA up-projections): over each pipeline block of a
   :class:`~lightning_ciuic.parallel.pipeline_module.PipelineModule`, else each block of the module's outermost
   ``nn.ModuleList`` s; a module with neither is an error.
4. **Pipeline cut** over ``pp`` (:func:`~lightning_ciuic.parallel.pipeline_module.build_pipeline`): this rank's
   stages kept in place, parameter names unchanged.
5. **FSDP2 units** over ``dp_shard`` (HSDP with ``dp_replicate``) when ``dims.sharded``: every data-parallel rank
   first takes the first one's weights, then :func:`~lightning_ciuic.parallel.fsdp.shard`. A module the user
   sharded already (``fully_shard`` in ``configure_model``, as for Lightning's ``ModelParallelStrategy``) keeps its
   units, which must shard over the data-parallel ranks; it is then driven as sharded whatever ``dims.dp_shard``.
6. **Materialisation**: meta tensors (``Trainer.init_module(empty_init=True)``) allocated on the mesh's device and
   initialised, shard by shard where sharded (:func:`~lightning_ciuic.parallel.fsdp.materialize`).

Call it once per module: its result is the module's layout (Lightning sets a model up for each of fit, validate,
test; the strategy keeps the first result and reuses it). A second call would take the shards it made for whole
tensors.

No Lightning imports.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_ciuic import compat
from lightning_ciuic.parallel.axes import Axis
from lightning_ciuic.parallel.dims import Meshes, ParallelDims
from lightning_ciuic.parallel.experts import DispatchCompression, DispatchMode, ExpertLayout, shard_experts
from lightning_ciuic.parallel.fsdp import FSDPLayout, ShardingConfig, default_units, found_sharding, has_meta_tensors, shard
from lightning_ciuic.parallel.fsdp import materialize as materialize_meta
from lightning_ciuic.parallel.fp8 import use_fp8_gemms
from lightning_ciuic.parallel.pipeline import PipelineRunner, block_modules
from lightning_ciuic.parallel.pipeline_module import PipelineConfig, PipelineModule, build_pipeline
from lightning_ciuic.parallel.recompute import Recompute, recompute_blocks
from lightning_ciuic.parallel.tensor import apply_tensor_parallel, gradients_in_parameter_placements, hugging_face_plan
from lightning_ciuic.tensors import device_of
from lightning_ciuic.wire.replicas import broadcast_from_first



class ParallelizeOptions(Protocol):
    """What :func:`parallelize` reads of a layout's options (``ParallelismConfig`` has these attributes)."""

    @property
    def pipeline(self) -> PipelineConfig: ...

    @property
    def sharding(self) -> ShardingConfig: ...  # with FSDP2's dtypes for the precision already in it

    @property
    def gradient_checkpointing(self) -> Recompute: ...

    @property
    def sequence_parallel(self) -> bool: ...  # under tp: the residual stream sharded on the sequence, the logits on the vocabulary

    @property
    def expert_dispatch_compression(self) -> DispatchCompression: ...

    @property
    def expert_dispatch(self) -> DispatchMode: ...  # "flat" or "hierarchical"

    @property
    def expert_devices_per_node(self) -> Optional[int]: ...  # the ep ranks' nodes (None: one node)

    @property
    def expert_node_limit(self) -> Optional[int]: ...  # opt-in: a token's experts on at most this many nodes

    @property
    def expert_dispatch_overlap(self) -> bool: ...  # two chunks per micro-batch, one's all-to-alls while the other computes

    @property
    def expert_input_storage(self) -> DispatchCompression: ...  # the experts' input rows kept for backward so encoded

    @property
    def gemm_precision(self) -> Optional[str]: ...  # "fp8": the blocks' linears and the ep experts by FP8 GEMMs

    @property
    def diloco(self) -> Optional[Any]: ...  # whole replicas that train apart: no user FSDP2 units


@dataclass
class Parallelized:
    """What :func:`parallelize` made of a module (see the module docstring)."""

    module: nn.Module
    meshes: Meshes
    pipeline: Optional[PipelineRunner] = None
    fsdp: Optional[FSDPLayout] = None  # the FSDP2 units, ours or the user's
    user_sharded: bool = False  # the units are the user's own fully_shard calls
    experts: Optional[ExpertLayout] = None  # expert parallelism's layout (dims.ep > 1)
    loss_parallel: bool = False  # the logits come out vocabulary-sharded (sequence parallelism's plan)

    @property
    def dims(self) -> ParallelDims:
        return self.meshes.dims

    @property
    def stages(self) -> tuple[nn.Module, ...]:
        return tuple(self.pipeline.stage_modules) if self.pipeline is not None else ()


def parallelize(
    module: nn.Module, layout: Union[Meshes, ParallelDims], options: ParallelizeOptions, *, materialize: bool = True
) -> Parallelized:
    """This rank's part of ``module`` in ``layout`` (see the module docstring)."""
    meshes = layout if isinstance(layout, Meshes) else layout.build("cuda" if torch.cuda.is_available() else "cpu")
    dims = meshes.dims
    device = device_of(meshes.world)
    user_fsdp = found_sharding(module)
    result = Parallelized(module, meshes)
    if dims.tp_enabled:
        result.loss_parallel = tensor_parallel(module, meshes.mesh(Axis.TP), options.sequence_parallel)
        if user_fsdp is None and not dims.sharded:  # FSDP2 redistributes the gradients it reduces itself
            gradients_in_parameter_placements(module)
    if user_fsdp is None and (dims.sharded or dims.ep_enabled):
        broadcast_from_first(module, meshes.mesh(Axis.DP))  # replicas start equal, as DDP's do; then each keeps its shards
    if dims.ep_enabled:
        if user_fsdp is not None:
            raise ValueError(
                f"{type(module).__name__} calls fully_shard itself, and expert_parallel_size={dims.ep} shards its"
                " experts first: leave sharding to the strategy (data_parallel_shard_size > 1), or use"
                " expert_parallel_size=1."
            )
        result.experts = shard_experts(
            module, meshes, options.expert_dispatch_compression, options.expert_dispatch, options.expert_devices_per_node,
            options.expert_node_limit, options.expert_dispatch_overlap, options.expert_input_storage,
        )
    if options.gemm_precision == "fp8":
        experts = list(result.experts.modules.items()) if result.experts is not None else []
        use_fp8_gemms(*named_blocks(module, "gemm_precision='fp8'"), experts)
        if result.experts is not None:
            result.experts.fp8 = True
    if options.gradient_checkpointing:
        checkpoint_blocks(module, options.gradient_checkpointing)
    if dims.pp_enabled:
        if user_fsdp is not None:
            raise ValueError(
                f"{type(module).__name__} calls fully_shard itself, and pipeline_parallel_size={dims.pp} cuts it into"
                " stages afterwards, which FSDP2 units do not survive: leave sharding to the strategy"
                " (data_parallel_shard_size > 1) or use pipeline_parallel_size=1."
            )
        result.pipeline = build_pipeline(module, meshes.mesh(Axis.PP), options.pipeline, device)
        result.pipeline.overlap_pairs = dims.ep_enabled and options.expert_dispatch_overlap
        if result.loss_parallel:  # the plan is sequence-parallel: stages hand each other 1/tp of the sequence
            result.pipeline.sequence_shards = dims.tp
        if result.experts is not None:
            result.experts.keep_within(result.stages)
    if user_fsdp is not None:
        check_user_sharding(module, user_fsdp, meshes.mesh(Axis.DP), options)
        result.fsdp, result.user_sharded = user_fsdp, True
    elif dims.sharded:
        result.fsdp = shard(module, meshes.fsdp_mesh, options.sharding, result.stages, experts=result.experts)
    if materialize and has_meta_tensors(module):
        materialize_meta(module, device)
    return result


def tensor_parallel_plan(
    module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False
) -> tuple[Optional[Mapping[str, ParallelStyle]], bool]:
    """``(plan, sequence parallel)``: the module's own plan (given ``sequence_parallel`` if its method takes it), or its
    Hugging Face ``_tp_plan`` translated; ``(None, False)`` if it has neither."""
    own = getattr(module, "tensor_parallel_plan", None)
    if callable(own):
        if "sequence_parallel" in inspect.signature(own).parameters:
            return own(tp_mesh, sequence_parallel=sequence_parallel), sequence_parallel
        return own(tp_mesh), False
    hf_plan = compat.hugging_face_tp_plan(module)
    if hf_plan:
        plan, _ = hugging_face_plan(module, hf_plan)
        return plan, False
    return None, False


def tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> bool:
    """Step 1: apply the module's tensor-parallel plan over ``tp_mesh`` unless it did so itself; whether its logits
    come out vocabulary-sharded (the plan is sequence-parallel)."""
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return False  # applied already: by the module's configure_model, or by an earlier call
    plan, sharded_logits = tensor_parallel_plan(module, tp_mesh, sequence_parallel)
    if not plan:
        raise ValueError(
            f"tensor_parallel_size={tp_mesh.size()}, but {type(module).__name__} has no tensor-parallel plan: every tp"
            " rank would compute the same thing on the same data. Give the module a tensor_parallel_plan(tp_mesh)"
            " method (names -> ColwiseParallel/RowwiseParallel), call parallelize_module(self, self.device_mesh['tp'],"
            " ...) in configure_model, or use tensor_parallel_size=1."
        )
    apply_tensor_parallel(module, tp_mesh, plan)
    return sharded_logits


def checkpoint_blocks(module: nn.Module, recompute: Recompute) -> None:
    """Step 3: ``recompute`` over the blocks (pipeline blocks, else the outermost layer lists' blocks)."""
    blocks, names = named_blocks(module, f"gradient_checkpointing={recompute}")
    recompute_blocks(blocks, recompute, names)


def named_blocks(module: nn.Module, option: str) -> tuple[list[nn.Module], list[str]]:
    """``(blocks, names)``: the pipeline blocks, else the outermost layer lists' blocks; ``TypeError`` naming
    ``option`` (what acts on each block) when there are none."""
    if isinstance(module, PipelineModule):
        names = list(module.pipeline_blocks())
        blocks = block_modules(module, names)
    else:
        named = {id(m): n for n, m in module.named_modules()}
        blocks = default_units(module)
        names = [named[id(b)] for b in blocks]
    if not blocks:
        raise TypeError(
            f"{option} acts in each block of the model, and {type(module).__name__} has neither pipeline blocks (the"
            " PipelineModule protocol: pipeline_blocks(), docs/pipeline.md) nor an nn.ModuleList of layers: give it"
            f" one of them, or drop {option.partition('=')[0]}."
        )
    return blocks, names


def check_user_sharding(module: nn.Module, layout: FSDPLayout, dp_mesh: DeviceMesh, options: ParallelizeOptions) -> None:
    """A user's own FSDP2 units must shard over exactly the data-parallel ranks (else gradients are averaged over
    the wrong group), and cannot be driven by DiLoCo, whose replicas are whole."""
    ranks = sorted(int(r) for r in layout.mesh.mesh.flatten().tolist())
    expected = sorted(int(r) for r in dp_mesh.mesh.flatten().tolist())
    if ranks != expected:
        raise ValueError(
            f"{type(module).__name__} calls fully_shard over ranks {ranks}, but this rank's data-parallel ranks are"
            f" {expected}: shard over self.device_mesh['data_parallel'] (or ['dp']), or leave sharding to the strategy"
            " (data_parallel_shard_size > 1)."
        )
    if options.diloco is not None:
        raise ValueError(
            f"{type(module).__name__} calls fully_shard itself, and diloco= trains whole replicas: remove the"
            " fully_shard calls, or the diloco argument."
        )

