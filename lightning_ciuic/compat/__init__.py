"""Every private part of Lightning, torch, transformers and LitData the pack touches, in one room.

Contract: the rest of the package reaches Lightning's and torch's private classes, attributes and hooks only
through the names below, so an upgrade that moves one breaks this package and its test (``tests/unit/test_compat.py``,
one check per touch point), loudly, instead of a training run somewhere else; ``tests/unit/test_privates.py`` checks
that no other module reaches one. The names live in four rooms by library, all importable from here:
:mod:`.lightning` (Lightning, LitData), :mod:`.distributed` (torch.distributed), :mod:`.modules` (autograd,
``nn.Module``, ops, transformers' models) and :mod:`.tracing` (the planner's fake step). Importing this module warns
once when the installed Lightning or torch is outside the range the suite ran on (:data:`TESTED`), and silences the
deprecation warnings of :data:`THIRD_PARTY_DEPRECATIONS`: raised inside Lightning by the torch we run on, once per
rank, about code neither we nor our users can change.

Touch points:

* Lightning: the launchers ``_SubprocessScriptLauncher`` / ``_MultiProcessingLauncher`` and its
  ``_WorkerOutput`` (our strategy starts processes as ``DDPStrategy`` does), with what it hands a spawned rank
  (``_GlobalStateSnapshot``, ``_disable_module_memory_sharing``: ours hands a forkserver rank the same); ``Strategy._reset_optimizers_and_schedulers``; where a strategy keeps its precision plugin
  (``Strategy._precision_plugin``, for our strategy's own ``precision_plugin`` property); the optimizer a
  ``LightningOptimizer`` wraps (``_optimizer``); the fit loop's progress counters (epoch and batch position,
  optimizer-step totals, ``_batches_that_stepped``) that snapshots rewind; the barrier that ends ``fit``'s restore and the
  loader states it leaves pending (``_load_combined_loader_states``); ``ModelCheckpoint._find_last_checkpoints``
  (what ``ckpt_path="last"`` resolves), which ``AsyncCheckpointer`` overrides.
* torch: ``PipelineStage._to_tensor`` (shape inference on zeros), ``torch.utils._python_dispatch.TorchDispatchMode``
  (timing tensor-parallel collectives), DCP's ``_load_state_dict`` with ``_EmptyStateDictLoadPlanner`` (loading a
  checkpoint whole in one process, as torch's own ``dcp_to_torch_save`` does), ``DeviceMesh._flatten`` (two mesh
  axes named as one, as torchtitan names ``dp_replicate x dp_shard`` "dp"), FSDP2's ``ReduceScatter`` interface
  (``set_custom_reduce_scatter`` is public, the class it takes is not), and the mesh of a user's ``fully_shard``
  unit (its state's parameter group); selective checkpointing's storage (the ``storage`` of the modes
  ``create_selective_checkpoint_contexts`` returns: kept for the zero-bubble schedules' second backward);
  non-reentrant checkpointing's unpack hook (``_checkpoint_hook``, its frames and holders: a region recomputed once
  for a split backward's two passes, ``share_recomputations``) and the weight groups of ``stage_backward_input``
  (``param_group_nodes_observed``);
  autograd's current graph task (``in_backward``: an activation-checkpointing
  recompute runs a module's forward again inside backward); ``DeviceMesh._unflatten`` (the expert view of a mesh
  axis, as torchtitan splits ``dp_shard`` into ``efsdp x ep``); ``nn.Module``'s own forward-hook tables (suspended while a step is routed
  through an FSDP2 root, so its hooks run once per step); a pipeline schedule's warm-up (``_warmup_p2p``, replaced where
  the planner gives stages their metadata), its point-to-point batches (``schedules._batch_p2p``: on the fake process
  group, their works made to hold their tensors; on any, a send's work waited for early: ``pipeline_send_works``), its
  order of actions with their communication (``pipeline_order_with_comms``; ``reorder_pipeline``: its compute
  reordered and its communication lowered again; ``full_backward_of``: an input backward as the full one) and ``MemTracker``'s module tracker (``_mod_tracker``: none for a
  pipeline's steps), and its runtime's state around DualPipeV's forward-backward pairs (``run_pairs_with``:
  receives, losses, backward counts, as torch 2.13's runtime keeps them); a thread's dispatch modes (``dispatch_modes``,
  handed to a helper thread); fake tensors' rules (``fake_impls.op_implementations_dict``) and the meta kernel of
  ``_grouped_mm`` (a float32 rule beside it while the planner steps).
* LitData (optional): its ``_DistributedEnv`` (the world a ``StreamingDataset`` splits its chunks over, kept as the
  dataset's ``distributed_env``; ``StreamingDataLoader.load_state_dict`` asks ``_DistributedEnv.detect()`` for it
  again), set to the data-parallel world by :mod:`lightning_ciuic.data.world`.
* transformers: the forward its ``use_experts_implementation`` gives an experts class, and its default gating
  (``integrations.moe._default_apply_gate``) against a class's own ``_apply_gate``
  (:func:`hugging_face_experts_layout`: which experts expert parallelism may take over without running them).
* Reached directly elsewhere until issue 46, each now one named function here: ``torch._grouped_mm`` (the experts'
  grouped GEMM), DTensor's ``compute_local_shape_and_global_offset`` (``torch.distributed.tensor._utils``), a
  transformers model's ``_tp_plan`` / ``_pp_plan``, ``LightningModule._device_mesh``, a LitData combined dataset's
  ``_datasets``, a schedule's ``_warmup_p2p`` replaced, ``OpOverload._overloadpacket``, c10d's
  ``_resolve_process_group``, the fake process group's ``FakeStore`` (``torch.testing._internal``), ``FakeTensorMode``
  (``torch._subclasses``) and the FLOP formulas of private aten ops (``_grouped_mm``, the CPU's flash attention).
"""


from __future__ import annotations

import importlib.metadata
import warnings

import torch

from lightning_ciuic.compat.distributed import (
    EmptyStateDictLoadPlanner,
    FSDPAllGather,
    FSDPReduceScatter,
    all_gather_single,
    allocate_receive_buffers,
    detach_pipeline_loss,
    fake_store,
    flatten_mesh,
    forget_dtensor_meshes,
    full_backward_of,
    param_group_nodes_observed,
    fsdp_gathered_params,
    fsdp_mesh,
    fsdp_end_backward,
    load_state_dict_into,
    local_shape,
    local_shape_and_offset,
    loss_parallel_backward_in_place,
    mesh_coordinates,
    mesh_groups,
    pipeline_order_with_comms,
    pipeline_schedule_order,
    pipeline_send_works,
    pipeline_sends_held,
    release_receive_buffers,
    reorder_pipeline,
    resolve_process_group,
    run_pairs_with,
    static_pipeline_warmup,
    unflatten_mesh,
    use_static_pipeline_warmup,
)
from lightning_ciuic.compat.lightning import (
    RESTORE_DONE_BARRIER,
    batch_index,
    epoch_position,
    launchers,
    layer_sync,
    litdata_children,
    litdata_detects,
    litdata_distributed_env,
    load_pending_loader_states,
    optimizers_of,
    precision_plugin_given,
    reset_optimizers_and_schedulers,
    rewind_step_counters,
    set_batches_processed,
    set_launcher,
    set_litdata_world,
    set_logged_batch_size,
    set_module_device_mesh,
    set_precision_plugin,
    spawn_handoff,
    unwrap_optimizer,
)
from lightning_ciuic.compat.modules import (
    HUGGING_FACE_EXPERTS_FLAGS,
    forward_hooks_suspended,
    grouped_mm,
    has_grouped_mm,
    scaled_mm,
    SCALED_MM_OP,
    hugging_face_experts_layout,
    hugging_face_pp_plan,
    hugging_face_tp_plan,
    in_backward,
    ATTENTION_OPS,
    FUNCTIONAL_REDUCE_SCATTER,
    profiler_ops_pass_selective_checkpointing,
    view_base,
    saved_tensors_hooks_outside,
    selective_checkpoint_contexts,
    is_torch_checkpoint_hook,
    RecomputationShared,
    share_recomputations,
)
from lightning_ciuic.compat.tracing import (
    TorchDispatchMode,
    WatchesShapePropagation,
    attention_held_as_cuda_holds_it,
    dispatch_modes,
    dtensor_shape_propagation_marked,
    fake_tensor_mode,
    grouped_mm_on_fake_tensors_in_any_dtype,
    hugging_face_sequences_unpacked,
    is_fake,
    memory_tracker,
    overload_packet,
    private_op_flop_formulas,
    push_dispatch_modes,
)

# Private hooks of Lightning's and torch's classes the pack's subclasses override (a subclass defines them by name, so
# they cannot go through a function here): "module.Class._hook" -> who overrides it, why, and since which version.
# tests/unit/test_privates.py holds this to what the package overrides; tests/unit/test_compat.py checks each exists.
OVERRIDDEN_PRIVATE_HOOKS = {
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint._find_last_checkpoints":
        "AsyncCheckpointer: what ckpt_path='last' resolves (Lightning 2.0+)",
    "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher._wrapping_function":
        "FullWeightsMultiProcessingLauncher: a forkserver rank's environment, streams and random state (Lightning 2.0+)",
    "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher._collect_rank_zero_results":
        "FullWeightsMultiProcessingLauncher: full (gathered, all stages) weights handed back (Lightning 2.0+)",
    "lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher._recover_results_in_main_process":
        "FullWeightsMultiProcessingLauncher: those weights loaded in the main process (Lightning 2.0+)",
    "lightning.pytorch.strategies.strategy.Strategy._configure_launcher":
        "HybridParallelStrategy: its launchers, as every Lightning strategy sets them (Lightning 2.0+)",
    "torch.distributed.pipelining.stage.PipelineStage._to_tensor":
        "parallel/pipeline.py's stage: shape inference on zeros (torch 2.4+)",
    "torch.distributed.pipelining.stage.PipelineStage._setup_forward_recv_info":
        "parallel/pipeline.py's stage: the activations' receive buffers dropped after set-up, allocated per micro-batch (torch 2.13)",
    "torch.distributed.pipelining.stage._PipelineStageBase._setup_backward_recv_info":
        "parallel/pipeline.py's stage: the output gradients' receive buffers, the same (torch 2.13)",
    "torch.distributed.tensor.parallel.style.ColwiseParallel._apply":
        "ColwiseSavingShard: torch's column-parallel linear, its forward keeping a gathered input's part (torch 2.2+)",
    "torch.distributed.tensor.parallel.style.ColwiseParallel._prepare_input_fn":
        "ColwiseSavingShard: a gathered input handed to its forward as the plain tensor it is (torch 2.2+)",
    "torch.distributed.tensor.parallel.style.ParallelStyle._apply":
        "HeadwiseReplicated, SharedRotaryKey, ReplicatedSavingShard: torch's way to write a ParallelStyle (torch 2.2+)",
}

# The ranges the suite ran on: (lowest, first untested) major.minor
TESTED = {"torch": ((2, 13), (2, 15)), "lightning": ((2, 6), (2, 7))}

__all__ = [
    "ATTENTION_OPS",
    "RecomputationShared",
    "share_recomputations",
    "param_group_nodes_observed",
    "SCALED_MM_OP",
    "scaled_mm",
    "FUNCTIONAL_REDUCE_SCATTER",
    "profiler_ops_pass_selective_checkpointing",
    "view_base",
    "saved_tensors_hooks_outside",
    "selective_checkpoint_contexts",
    "is_torch_checkpoint_hook",
    "layer_sync",
    "set_launcher",
    "precision_plugin_given",
    "set_precision_plugin",
    "EmptyStateDictLoadPlanner",
    "OVERRIDDEN_PRIVATE_HOOKS",
    "FSDPAllGather",
    "FSDPReduceScatter",
    "HUGGING_FACE_EXPERTS_FLAGS",
    "RESTORE_DONE_BARRIER",
    "TESTED",
    "THIRD_PARTY_DEPRECATIONS",
    "TorchDispatchMode",
    "WatchesShapePropagation",
    "all_gather_single",
    "attention_held_as_cuda_holds_it",
    "batch_index",
    "check_versions",
    "dtensor_shape_propagation_marked",
    "epoch_position",
    "fake_store",
    "fake_tensor_mode",
    "flatten_mesh",
    "forget_dtensor_meshes",
    "full_backward_of",
    "forward_hooks_suspended",
    "fsdp_gathered_params",
    "fsdp_mesh",
    "fsdp_end_backward",
    "grouped_mm",
    "grouped_mm_on_fake_tensors_in_any_dtype",
    "has_grouped_mm",
    "hugging_face_experts_layout",
    "hugging_face_pp_plan",
    "hugging_face_sequences_unpacked",
    "hugging_face_tp_plan",
    "in_backward",
    "is_fake",
    "launchers",
    "litdata_children",
    "litdata_detects",
    "litdata_distributed_env",
    "load_pending_loader_states",
    "load_state_dict_into",
    "local_shape",
    "loss_parallel_backward_in_place",
    "local_shape_and_offset",
    "memory_tracker",
    "mesh_coordinates",
    "mesh_groups",
    "optimizers_of",
    "overload_packet",
    "pipeline_schedule_order",
    "pipeline_order_with_comms",
    "pipeline_send_works",
    "pipeline_sends_held",
    "private_op_flop_formulas",
    "reorder_pipeline",
    "reset_optimizers_and_schedulers",
    "resolve_process_group",
    "rewind_step_counters",
    "set_batches_processed",
    "set_litdata_world",
    "set_logged_batch_size",
    "set_module_device_mesh",
    "spawn_handoff",
    "static_pipeline_warmup",
    "unflatten_mesh",
    "unwrap_optimizer",
    "use_static_pipeline_warmup",
]


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_versions(versions: dict[str, str]) -> list[str]:
    """One message per package whose version is outside :data:`TESTED` (empty when all are inside)."""
    messages = []
    for package, version in versions.items():
        low, high = TESTED[package]
        if not low <= _major_minor(version) < high:
            messages.append(
                f"lightning_ciuic was tested with {package} {low[0]}.{low[1]} up to before {high[0]}.{high[1]}, found"
                f" {version}: it touches private parts of {package} (lightning_ciuic/compat/ lists them)."
            )
    return messages


def _warn_untested() -> None:
    versions = {"torch": torch.__version__}
    try:  # the installed version, without importing Lightning (the framework-free floors import this module)
        versions["lightning"] = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:
        pass
    for message in check_versions(versions):
        warnings.warn(message, stacklevel=2)


_warn_untested()

THIRD_PARTY_DEPRECATIONS = (
    # Lightning 2.6's pytree helpers on torch >= 2.10 (lightning/pytorch/utilities/_pytree.py)
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)
for _message in THIRD_PARTY_DEPRECATIONS:
    warnings.filterwarnings("ignore", message=_message)
