"""Every private part of Lightning and torch the pack touches, in one room.

Contract: the rest of the package reaches Lightning's and torch's private classes, attributes and hooks only
through the names below, so an upgrade that moves one breaks this file and its test (``tests/unit/test_compat.py``,
one check per touch point), loudly, instead of a training run somewhere else. Importing this module warns once
when the installed Lightning or torch is outside the range the suite ran on (:data:`TESTED`), and silences the
deprecation warnings of :data:`THIRD_PARTY_DEPRECATIONS`: raised inside Lightning by the torch we run on, once per
rank, about code neither we nor our users can change.

Touch points:

* Lightning: the launchers ``_SubprocessScriptLauncher`` / ``_MultiProcessingLauncher`` and its
  ``_WorkerOutput`` (our strategy starts processes as ``DDPStrategy`` does), with what it hands a spawned rank
  (``_GlobalStateSnapshot``, ``_disable_module_memory_sharing``: ours hands a forkserver rank the same); ``Strategy._reset_optimizers_and_schedulers``; the optimizer a
  ``LightningOptimizer`` wraps (``_optimizer``); the fit loop's progress counters (epoch and batch position,
  optimizer-step totals, ``_batches_that_stepped``) that snapshots rewind; the barrier that ends ``fit``'s restore and the
  loader states it leaves pending (``_load_combined_loader_states``); ``ModelCheckpoint._find_last_checkpoints``
  (what ``ckpt_path="last"`` resolves), which ``AsyncCheckpointer`` overrides.
* torch: ``PipelineStage._to_tensor`` (shape inference on zeros), ``torch.utils._python_dispatch.TorchDispatchMode``
  (timing tensor-parallel collectives), DCP's ``_load_state_dict`` with ``_EmptyStateDictLoadPlanner`` (loading a
  checkpoint whole in one process, as torch's own ``dcp_to_torch_save`` does), ``DeviceMesh._flatten`` (two mesh
  axes named as one, as torchtitan names ``dp_replicate x dp_shard`` "dp"), FSDP2's ``ReduceScatter`` interface
  (``set_custom_reduce_scatter`` is public, the class it takes is not), and the mesh of a user's ``fully_shard``
  unit (its state's parameter group); autograd's current graph task (``in_backward``: an activation-checkpointing
  recompute runs a module's forward again inside backward); the attention kernels' private aten ops
  (``ATTENTION_OPS``: ``aten._scaled_dot_product_*``, whose outputs selective recomputation keeps); the profiler's
  record_function ops passed through selective checkpointing (``SAC_IGNORED_OPS``); a view's base
  tensor (``view_base``: ``Tensor._base``, how recomputation knows a view of a recomputed output); ``DeviceMesh._unflatten`` (the expert view of a mesh
  axis, as torchtitan splits ``dp_shard`` into ``efsdp x ep``); ``nn.Module``'s own forward-hook tables (suspended while a step is routed
  through an FSDP2 root, so its hooks run once per step); a pipeline schedule's warm-up (``_warmup_p2p``, replaced where
  the planner gives stages their metadata), its point-to-point batches (``schedules._batch_p2p``: on the fake process
  group, their works made to hold their tensors) and ``MemTracker``'s module tracker (``_mod_tracker``: none for a
  pipeline's steps); fake tensors' rules (``fake_impls.op_implementations_dict``) and the meta kernel of
  ``_grouped_mm`` (a float32 rule beside it while the planner steps).
* LitData (optional): its ``_DistributedEnv`` (the world a ``StreamingDataset`` splits its chunks over, kept as the
  dataset's ``distributed_env``; ``StreamingDataLoader.load_state_dict`` asks ``_DistributedEnv.detect()`` for it
  again), set to the data-parallel world by :mod:`lightning_ciuic.data.world`.
* transformers: the forward its ``use_experts_implementation`` gives an experts class, and its default gating
  (``integrations.moe._default_apply_gate``) against a class's own ``_apply_gate``
  (:func:`hugging_face_experts_layout`: which experts expert parallelism may take over without running them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict_into
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatter
from torch.utils._python_dispatch import TorchDispatchMode

# The ranges the suite ran on: (lowest, first untested) major.minor
TESTED = {"torch": ((2, 13), (2, 15)), "lightning": ((2, 6), (2, 7))}

__all__ = [
    "ATTENTION_OPS",
    "EmptyStateDictLoadPlanner",
    "FSDPAllGather",
    "FSDPReduceScatter",
    "TESTED",
    "TorchDispatchMode",
    "batch_index",
    "check_versions",
    "epoch_position",
    "flatten_mesh",
    "forward_hooks_suspended",
    "hugging_face_experts_layout",
    "in_backward",
    "fsdp_mesh",
    "launchers",
    "litdata_distributed_env",
    "litdata_detects",
    "set_litdata_world",
    "unflatten_mesh",
    "view_base",
    "profiler_ops_pass_selective_checkpointing",
    "load_state_dict_into",
    "reset_optimizers_and_schedulers",
    "rewind_step_counters",
    "shift_batch_counters",
    "spawn_handoff",
    "unwrap_optimizer",
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
                f" {version}: it touches private parts of {package} (lightning_ciuic/compat.py lists them)."
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


# -- Lightning --------------------------------------------------------------------------------------
def launchers() -> tuple[type, type, type]:
    """Lightning's subprocess-script launcher, its multiprocessing launcher (whose ``_wrapping_function`` and
    ``_collect_rank_zero_results`` ours overrides) and the ``_WorkerOutput`` the latter returns."""
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
    from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput

    return _SubprocessScriptLauncher, _MultiProcessingLauncher, _WorkerOutput


def spawn_handoff() -> tuple[type, Any]:
    """What Lightning's launcher does for a ``spawn`` rank only, and ours for a ``forkserver`` rank too: the
    ``_GlobalStateSnapshot`` (deterministic flags, random states) it restores in the rank, and
    ``_disable_module_memory_sharing`` (a module pickled to a CPU rank arrives in shared memory; the rank clones it)."""
    from lightning.pytorch.strategies.launchers.multiprocessing import (
        _disable_module_memory_sharing,
        _GlobalStateSnapshot,
    )

    return _GlobalStateSnapshot, _disable_module_memory_sharing


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def optimizers_of(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers of what a ``configure_optimizers()`` returned, in any of Lightning's forms (Lightning's own
    reading of them)."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    return list(_configure_optimizers(configured)[0])


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    strategy._reset_optimizers_and_schedulers()


def set_logged_batch_size(trainer: Any, batch_size: int) -> None:
    """The batch size ``self.log(..., on_epoch=True)`` weighs this step's values by (else taken from the batch)."""
    results = getattr(trainer, "_results", None)
    if results is not None:
        results.batch_size = batch_size


def batch_index(trainer: Any) -> int:
    """The index of the running batch within its epoch."""
    return trainer.fit_loop.epoch_loop.batch_idx


def epoch_position(trainer: Any) -> tuple[int, int]:
    """(epochs processed, batches processed in the running epoch) of the fit loop: ``(e, 0)`` between epochs. Once
    the fit loop has counted an epoch processed (at its end, or when ``max_steps`` ends training mid-epoch), the
    epoch loop's batch counters still hold that epoch's batches: they are not the next epoch's."""
    epochs = trainer.fit_loop.epoch_progress.current
    running = epochs.started > epochs.processed
    return epochs.processed, trainer.fit_loop.epoch_loop.batch_progress.current.processed if running else 0


def shift_batch_counters(trainer: Any, shift: int) -> None:
    """Move every counter of the epoch loop's batch progress by ``shift`` batches."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    for counter in ("ready", "started", "processed", "completed"):
        setattr(current, counter, getattr(current, counter) + shift)


# Lightning calls ``strategy.barrier`` by this name once ``fit``'s checkpoint restore is over (a ``ckpt_path`` or
# none), before the sanity check and the fit loop: the end of the restore that nothing public marks.
RESTORE_DONE_BARRIER = "_CheckpointConnector.resume_end"


def load_pending_loader_states(trainer: Any) -> None:
    """Give training loaders that were set up before a restore the states the restore brought (Lightning loads them
    only when it sets a loader up: issue #20550). A no-op when nothing is pending or no loader is set up yet."""
    trainer.fit_loop._load_combined_loader_states()


def rewind_step_counters(trainer: Any, loops: dict[str, Any]) -> None:
    """Set the optimizer-step totals and the logging step from a saved ``fit_loop.state_dict()``."""
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]
    epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.load_state_dict(automatic)
    manual = loops["epoch_loop.manual_optimization.optim_step_progress"]["total"]
    epoch_loop.manual_optimization.optim_step_progress.total.load_state_dict(manual)
    epoch_loop._batches_that_stepped = loops["epoch_loop.state_dict"]["_batches_that_stepped"]


def all_gather_single(output: torch.Tensor, input: torch.Tensor) -> None:
    """``torch.distributed.all_gather_single`` (torch >= 2.13, where ``all_gather_into_tensor`` warns deprecated)."""
    import torch.distributed as dist

    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(output, input)


# -- LitData ------------------------------------------------------------------------------------------
def litdata_distributed_env(world_size: int, global_rank: int, num_nodes: int) -> Any:
    """A LitData ``_DistributedEnv``: the world a ``StreamingDataset`` assigns chunks over."""
    from litdata.utilities.env import _DistributedEnv

    return _DistributedEnv(world_size=world_size, global_rank=global_rank, num_nodes=num_nodes)


def set_litdata_world(dataset: Any, env: Any) -> Any:
    """Make ``dataset`` (a ``StreamingDataset``) split over ``env``; returns the environment it had."""
    before, dataset.distributed_env = dataset.distributed_env, env
    return before


@contextmanager
def litdata_detects(env: Any) -> Iterator[None]:
    """Inside, LitData's ``_DistributedEnv.detect()`` returns ``env`` (``StreamingDataLoader.load_state_dict`` compares
    the saved world size with the one it detects)."""
    from litdata.utilities.env import _DistributedEnv

    original = _DistributedEnv.__dict__["detect"]
    _DistributedEnv.detect = classmethod(lambda cls: env)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _DistributedEnv.detect = original  # type: ignore[method-assign]


def flatten_mesh(mesh: Any, axes: tuple[str, ...], name: str) -> Any:
    """Name ``axes`` of ``mesh`` together as one axis ``name`` (``mesh[name]`` works afterwards); returns it."""
    return mesh[axes]._flatten(name)


def unflatten_mesh(mesh: Any, axis: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """The mesh with ``axis`` split into ``names`` of ``sizes`` (same ranks, same root: FSDP2 accepts DTensors on one
    for units on the other)."""
    return mesh._unflatten(axis, sizes, names)


def fsdp_mesh(unit: Any) -> Any:
    """The mesh an FSDP2 unit (a ``fully_shard`` ed module) shards its own parameters over; ``None`` if it owns none."""
    group = unit._get_fsdp_state()._fsdp_param_group
    return group.mesh_info.mesh if group is not None else None


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a checkpointed block's forward recomputed)."""
    return torch._C._current_graph_task_id() != -1


# The attention kernels' private aten ops (those this torch build has), whose outputs selective activation
# checkpointing keeps (parallel/recompute.py), as torchtitan's policy does.
ATTENTION_OPS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)


def profiler_ops_pass_selective_checkpointing() -> None:
    """Selective activation checkpointing runs the profiler's record_function ops as they come, neither kept nor
    counted (torch's ``SAC_IGNORED_OPS``): FSDP2's hooks open more of them in a recomputed forward than in the forward
    (a unit inside a block: the experts), which SAC took for a different forward ("invocation index 2 encountered
    during backward but not found in storage")."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        if packet is not None:
            SAC_IGNORED_OPS.update(getattr(packet, overload) for overload in packet.overloads())


def view_base(tensor: torch.Tensor) -> Any:
    """The tensor ``tensor`` is a view of (autograd's ``_base``: the root, for a view of a view), else ``None``."""
    return tensor._base


@contextmanager
def forward_hooks_suspended(module: Any) -> Iterator[None]:
    """Calls of ``module`` run its ``forward`` alone, without its own forward (pre-)hooks, inside this context."""
    saved = module._forward_pre_hooks, module._forward_hooks
    module._forward_pre_hooks, module._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        module._forward_pre_hooks, module._forward_hooks = saved


@functools.cache
def _hugging_face_experts_forward() -> Any:
    """The code of the forward transformers' ``use_experts_implementation`` gives every experts class it decorates
    (one function, defined once in the decorator), and transformers' default gating; ``None`` without them."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    decorated = moe.use_experts_implementation(type("_Experts", (torch.nn.Module,), {"forward": lambda self: None}))
    return decorated.forward.__code__, moe._default_apply_gate


HUGGING_FACE_EXPERTS_FLAGS = ("is_concatenated", "is_transposed", "has_bias", "has_gate", "has_post_expert_norm")


def hugging_face_experts_layout(module: Any) -> Any:
    """For a transformers experts module (its class decorated by ``use_experts_implementation``, its forward that
    decorator's: not replaced by a subclass or on the instance), ``{flag: value}`` of the decorator's layout flags
    (:data:`HUGGING_FACE_EXPERTS_FLAGS`) and ``default_gate``: whether it gates as transformers does by default,
    ``act_fn(gate) * up`` (its class has no ``_apply_gate`` of its own). ``None`` for any other module."""
    if "transformers" not in sys.modules:
        return None  # nothing was built from a transformers class
    found = _hugging_face_experts_forward()
    forward = getattr(getattr(type(module), "forward", None), "__code__", None)
    if found is None or forward is not found[0] or "forward" in vars(module):
        return None
    layout = {flag: getattr(module, flag, None) for flag in HUGGING_FACE_EXPERTS_FLAGS}
    layout["default_gate"] = getattr(type(module), "_apply_gate", None) is found[1]
    return layout


def mesh_coordinates(mesh: Any) -> dict[int, tuple[int, ...]]:
    """Every global rank's coordinate on ``mesh``'s axes, for every group of ranks such a mesh has (a sub-mesh
    ``mesh["tp"]`` holds only this rank's group; its layout gives them all): ``{rank: coordinate}``."""
    full = mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1, *mesh.shape)
    coordinates: dict[int, tuple[int, ...]] = {}
    for group in full:
        for index in range(group.numel()):
            coordinates[int(group.flatten()[index])] = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), tuple(mesh.shape)))
    return coordinates


@functools.lru_cache(maxsize=1 << 16)
def local_shape(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: Any) -> tuple[int, ...]:
    """(Cached: a model repeats its layers' shapes.) The shape of the shard a rank at ``coordinate`` of a mesh of ``mesh_shape`` holds of a DTensor of
    ``global_shape`` placed by ``placements`` (DTensor's own rule: ``torch.chunk`` sizes, uneven shards last)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return tuple(_compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate), placements, skip_offset=True)[0])


def fsdp_gathered_params(unit: Any) -> list[tuple[int, int]]:
    """``(values gathered, element size)`` of each parameter an FSDP2 unit owns: its padded shard times the sharding
    ranks (what the unit's all-gather outputs), in the shard's dtype."""
    group = unit._get_fsdp_state()._fsdp_param_group
    if group is None:
        return []
    ranks = group.mesh_info.shard_mesh_size
    return [(fp.padded_sharded_param_size.numel() * ranks, fp.sharded_param.element_size()) for fp in group.fsdp_params]


def forget_dtensor_meshes() -> None:
    """Forget the meshes DTensor keeps between calls, when their process groups end (a planner starts a fake world per
    rank it builds): its random-number tracker (made on the first mesh it saw) and its sharding-propagation cache,
    whose entries hold the meshes of earlier worlds (meshes compare equal across worlds, their groups do not), and
    its redistribution plans (a flattened transform keeps its mesh), and the C++ fast path's sharding cache."""
    import torch.distributed.tensor._random as dtensor_random
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor import DTensor

    dtensor_random._rng_tracker = None
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    if hasattr(propagator._propagate_tensor_meta_cached, "cache_clear"):
        propagator._propagate_tensor_meta_cached.cache_clear()
    if hasattr(redistribute._gen_transform_infos, "cache_clear"):
        redistribute._gen_transform_infos.cache_clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ dispatch fast path's own cache
        torch._C._clear_DTensor_sharding_propagator_cache()


class _CountingLock:
    """A reusable context: counts its depth in ``depth[0]`` around the ``lock`` it wraps."""

    def __init__(self, lock: Any, depth: list[int]) -> None:
        self.lock, self.depth = lock, depth

    def __enter__(self) -> None:
        self.lock.__enter__()
        self.depth[0] += 1

    def __exit__(self, *exc: Any) -> Any:
        self.depth[0] -= 1
        return self.lock.__exit__(*exc)


@contextmanager
def dtensor_shape_propagation_marked(depth: list[int]) -> Iterator[None]:
    """Inside, ``depth[0] > 0`` while DTensor's sharding propagation runs an op on fake tensors of its global shapes
    (to learn the output's shape; no kernel computes it). Wraps ``ShardingPropagator._fake_mode_lock``, the context
    torch enters around that run (a class attribute meant to be replaced: multi-threaded tests set a lock there)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    lock = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = _CountingLock(lock, depth)
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = lock


class WatchesShapePropagation:
    """A mixin for a dispatch mode: ``propagating`` is true, while the mode is entered, as long as DTensor's sharding
    propagation runs an op (:func:`dtensor_shape_propagation_marked`), whose fake tensors of the global shapes no
    kernel computes and no device holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._propagating = [0]
        self._marking = contextlib.ExitStack()

    @property
    def propagating(self) -> bool:
        return self._propagating[0] > 0

    def __enter__(self) -> Any:
        self._marking.enter_context(dtensor_shape_propagation_marked(self._propagating))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._marking.close()


@contextmanager
def hugging_face_sequences_unpacked() -> Iterator[None]:
    """Inside, transformers' masks take the path of a batch without packed sequences, as they do for real tensors.

    transformers checks whether the position ids pack several sequences into one row (``masking_utils.
    find_packed_sequence_indices``: ``(...).all()`` on their values), and skips the check for fake tensors, assuming
    they may: it then builds an explicit ``[B, 1, S, S]`` mask and per-row position tables that a real run of the same
    unpacked batch never allocates. The planner's step batches are unpacked by construction (``token_batch``)."""
    try:
        import transformers.masking_utils as masking
    except ImportError:
        yield
        return
    packed = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = packed


def static_pipeline_warmup(stages: Any, has_backward: bool, p2p_done: bool) -> None:
    """A pipeline schedule's warm-up (``_warmup_p2p``) for stages given the metadata of their inputs and outputs:
    each set to torch's STATIC inference mode, without the vote torch's warm-up sends between stages (on a fake
    process group a receive delivers nothing, and on fake tensors the vote's ``.item()`` has no value)."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


class _NoModuleTracking:
    """torch's ``ModTracker`` as ``MemTracker`` uses it, tracking no module: no hooks, never inside a module or backward."""

    parents = frozenset({"Global"})
    is_bw = False

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> "_NoModuleTracking":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def memory_tracker(per_module: bool = True) -> Any:
    """torch's ``MemTracker``, blind to DTensor's sharding propagation: its ops on fake tensors of the global shapes
    (:func:`dtensor_shape_propagation_marked`) allocate nothing on a device. ``MemTracker`` skips them where they run
    under a fake mode of their own, but counts them when it is entered inside the ``FakeTensorMode`` they run under,
    as the planner's step does: a step whose ops DTensor has not yet cached (a first step) then peaked above a real one.

    ``per_module=False``: totals and peak only, without the per-module statistics, whose module hooks refuse a module
    called more than once per step outside any other module, which is how a pipeline schedule calls each stage (once
    per micro-batch), and whose backward hooks fail under ``autograd.grad``, which a pipeline stage runs to learn its
    gradients' shapes. Its ``ModTracker`` (``_mod_tracker``) is then one tracking no module; every tensor an op
    allocates is still counted (its dispatch mode), and the tensors ``track_external`` registers."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PropagationBlindMemTracker(WatchesShapePropagation, MemTracker):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            if self.propagating:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    tracker = PropagationBlindMemTracker()
    if not per_module:
        tracker._mod_tracker = _NoModuleTracking()
    return tracker


class _HoldingWork:
    """A point-to-point work that keeps its tensors until it is waited on (and is otherwise the work)."""

    def __init__(self, work: Any, tensors: list) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._tensors = []
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextmanager
def pipeline_sends_held() -> Iterator[None]:
    """Inside, the works of a pipeline schedule's point-to-point batches (``schedules._batch_p2p``) keep their tensors
    until waited, as gloo's and NCCL's do. The fake process group's works keep nothing, so an activation a stage sends
    would be freed at once where a real run holds it until the schedule waits (the multi-stage schedules wait for
    their sends at the end of the step)."""
    from torch.distributed.pipelining import schedules

    batch = schedules._batch_p2p

    def holding(p2p_ops: Any, desc: Any = None) -> list:
        tensors = [op.tensor for op in p2p_ops]
        return [_HoldingWork(work, tensors) for work in batch(p2p_ops, desc)]

    schedules._batch_p2p = holding
    try:
        yield
    finally:
        schedules._batch_p2p = batch


@contextmanager
def grouped_mm_on_fake_tensors_in_any_dtype() -> Iterator[None]:
    """Inside, fake tensors run ``torch._grouped_mm`` in float32 and float16 too, as the CPU kernel computes it: the
    meta kernel fake tensors run (``_meta_registrations.meta_grouped_mm``) keeps a CUDA check that refuses all but
    bfloat16. The output's shape and strides are the meta kernel's for bfloat16 inputs of the same shapes, in the
    inputs' dtype (or ``out_dtype``). Registered as a fake-tensor rule for the op (``fake_impls.
    op_implementations_dict``) while inside; bfloat16 goes on to the meta kernel as before."""
    from torch._meta_registrations import meta_grouped_mm
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    op = torch.ops.aten._grouped_mm.default

    def shape_of_grouped_mm(fake_mode: Any, func: Any, mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
        if mat_a.dtype == torch.bfloat16:
            return NotImplemented
        with in_kernel_invocation_manager(fake_mode):
            as_bf16 = [torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device="meta") for t in (mat_a, mat_b)]
            shape = meta_grouped_mm(*as_bf16, offs=offs, bias=bias)
            out = torch.empty_strided(shape.shape, shape.stride(), dtype=out_dtype or mat_a.dtype, device="meta")
        return FakeTensor(fake_mode, out, mat_a.device)

    if op in fake_impls.op_implementations_dict:
        yield  # torch has its own rule now
        return
    fake_impls.op_implementations_dict[op] = shape_of_grouped_mm
    try:
        yield
    finally:
        fake_impls.op_implementations_dict.pop(op, None)


@contextmanager
def attention_held_as_cuda_holds_it() -> Iterator[None]:
    """Inside, ``F.scaled_dot_product_attention`` of a value head dim other than the query's (multi-head latent
    attention: DeepSeek-V2/V3's 192-dim queries and keys, 128-dim values) runs as CUDA runs it, by the memory-efficient
    kernel (``aten._scaled_dot_product_efficient_attention``, its meta kernel on fake tensors), which keeps the output
    and its log-sum-exp for the backward. The CPU's flash kernel refuses such inputs and its math path keeps the
    ``L x S`` attention weights (128 heads x 4096 x 4096 x 2 bytes: 4 GiB per layer and sequence). Same FLOP formula
    (two products of ``L x S`` per head, each way). A boolean mask becomes the additive mask CUDA's kernels take, as
    torch's dispatch makes it; grouped-query inputs (``enable_gqa``) and dtypes the kernel lacks go on as before."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> torch.Tensor:
        if (value.shape[-1] == query.shape[-1] or key.shape[-1] != query.shape[-1] or enable_gqa
                or query.dtype not in (torch.float16, torch.bfloat16, torch.float32)):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        bias = attn_mask
        if bias is not None:
            if bias.dtype == torch.bool:
                bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill_(~bias, float("-inf"))
            bias = bias.expand(*query.shape[:-1], key.shape[-2])
        needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_grad, dropout_p, is_causal, scale=scale,
        )
        return out[0]

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original
