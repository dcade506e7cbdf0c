"""torch.distributed's private parts the pack touches (see :mod:`lightning_ciuic.compat`): DCP's whole-checkpoint load,
FSDP2's collectives' interfaces and unit state, DeviceMesh's flatten/unflatten and layout, DTensor's shard rule and
caches, c10d's group registry, the fake process group's store, and a pipeline schedule's warm-up, point-to-point
batches and order of actions (its communication too), and its forward-backward pairs' custom function."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist

# re-exported by lightning_ciuic.compat: DCP's whole-checkpoint load in one process (torch 2.2+), FSDP2's collectives
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner  # noqa: F401
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as load_state_dict_into  # noqa: F401
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGather  # noqa: F401
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatter  # noqa: F401


def all_gather_single(output: torch.Tensor, input: torch.Tensor) -> None:
    """``torch.distributed.all_gather_single`` (torch >= 2.13, where ``all_gather_into_tensor`` warns deprecated)."""
    import torch.distributed as dist

    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(output, input)


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


def mesh_coordinates(mesh: Any) -> dict[int, tuple[int, ...]]:
    """Every global rank's coordinate on ``mesh``'s axes, for every group of ranks such a mesh has (a sub-mesh
    ``mesh["tp"]`` holds only this rank's group; its layout gives them all): ``{rank: coordinate}``."""
    full = mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1, *mesh.shape)
    coordinates: dict[int, tuple[int, ...]] = {}
    for group in full:
        for index in range(group.numel()):
            coordinates[int(group.flatten()[index])] = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), tuple(mesh.shape)))
    return coordinates


def mesh_groups(mesh: Any) -> list[list[int]]:
    """Every group of ranks a 1-D sub-mesh such as ``mesh["ep"]`` has over the world (global ranks, in mesh order)."""
    full = mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1, mesh.size())
    return [[int(r) for r in group.tolist()] for group in full]


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


def fsdp_end_backward(root: Any, reduce: bool) -> None:
    """End the backward passes an FSDP2 root and its units ran outside autograd's own end (a pipeline stage's, or
    with ``set_requires_gradient_sync(False)``): with ``reduce``, reduce-scatter the unsharded gradients held through
    them in one go and reshard, as torch's pipeline stage does after a schedule's last backward
    (``_PipelineStageBase.perform_reduce_grad``: FSDP2's ``post_backward`` of each parameter group, then its root's
    final callback); without, the same end with the gradients held and the weights kept gathered (an accumulation
    micro-step: the final callback readies the root for the next forward)."""
    from torch.distributed.fsdp import fully_shard

    root.set_is_last_backward(reduce)
    root.set_reshard_after_backward(reduce)
    root.set_requires_gradient_sync(reduce)
    state = fully_shard.state(root)
    for unit_state in state._state_ctx.all_states:
        for group in unit_state._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


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


def static_pipeline_warmup(stages: Any, has_backward: bool, p2p_done: bool) -> None:
    """A pipeline schedule's warm-up (``_warmup_p2p``) for stages given the metadata of their inputs and outputs:
    each set to torch's STATIC inference mode, without the vote torch's warm-up sends between stages (on a fake
    process group a receive delivers nothing, and on fake tensors the vote's ``.item()`` has no value)."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


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
def pipeline_send_works(wrap: Callable[[bool, list], list]) -> Iterator[None]:
    """Inside, the works of a pipeline schedule's point-to-point batches (``schedules._batch_p2p``, torch 2.13) are
    what ``wrap(sends_only, works)`` makes of them (``sends_only``: every op of the batch a send)."""
    from torch.distributed.pipelining import schedules

    batch = schedules._batch_p2p

    def wrapped(p2p_ops: Any, desc: Any = None) -> list:
        return wrap(all(op.op is dist.isend for op in p2p_ops), batch(p2p_ops, desc))

    schedules._batch_p2p = wrapped
    try:
        yield
    finally:
        schedules._batch_p2p = batch


def pipeline_order_with_comms(schedule: Any) -> Optional[tuple[dict[int, list[tuple[str, int, int]]], dict[int, int]]]:
    """A multi-stage schedule's actions on every rank, communication included (``_PipelineScheduleRuntime.
    pipeline_order_with_comms``, which its runtime executes, torch 2.5+), as ``(kind, stage, micro-batch)`` (an
    ``OVERLAP_F_B`` as its parts; actions of no micro-batch left out), and the rank of each stage
    (``stage_index_to_group_rank``); ``None`` for a schedule without them (GPipe's and 1F1B's own loops)."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        return None
    return (
        {
            rank: [
                (part.computation_type.value, part.stage_index, part.microbatch_index)
                for action in actions if action is not None
                for part in (action.sub_actions or (action,)) if part.microbatch_index is not None
            ]
            for rank, actions in order.items()
        },
        dict(schedule.stage_index_to_group_rank),
    )


def release_receive_buffers(receive_infos: Any) -> None:
    """Each received tensor of a pipeline stage's ``_RecvInfo`` entries (the ``args_recv_info`` or ``grad_recv_info``
    of one micro-batch, torch 2.13) dropped: its buffer becomes an empty tensor of its dtype and device. A root
    argument and a gradient that is ``None`` (no buffer) are left as they are."""
    for info in receive_infos:
        if not info.is_root_arg and info.buffer is not None and info.tensor_meta is not None:
            info.buffer = info.buffer.new_empty(0)


def detach_pipeline_loss(loss: Any) -> None:
    """A pipeline's last stage's loss of one micro-batch, detached in place (its value kept) once its backward, or its
    input pass under a split backward (whose weight pass reads the graph's intermediates, not the loss), has run; ``None``
    (another stage's) left alone. The schedule keeps every micro-batch's loss to the step's end (``_internal_losses``,
    then the step's ``losses``, torch 2.13), and with it the loss's graph, whose ``AccumulateGrad`` node of the stage's
    input holds that input: one activation a micro-batch (torch detaches the stage's output after its backward, not the
    loss, which still reaches the graph through it)."""
    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None and not loss._is_view():
        loss.detach_()


def allocate_receive_buffers(receive_infos: Any, device: torch.device) -> None:
    """Each received tensor of ``receive_infos`` (as :func:`release_receive_buffers`) given a fresh buffer of its
    metadata's shape, as torch's stage allocates it at set-up (``_make_tensor_from_meta``, torch 2.13)."""
    from torch.distributed.pipelining.stage import _make_tensor_from_meta

    for info in receive_infos:
        if not info.is_root_arg and info.buffer is not None and info.tensor_meta is not None:
            info.buffer = _make_tensor_from_meta(info.tensor_meta, device)


def local_shape_and_offset(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and global offset of this rank's shard of a DTensor (``torch.distributed.tensor._utils.
    compute_local_shape_and_global_offset``: a private module, torch 2.4+)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


def use_static_pipeline_warmup(schedule: Any) -> None:
    """A pipeline schedule warms up by :func:`static_pipeline_warmup` (its ``_warmup_p2p`` replaced, torch 2.13)."""
    schedule._warmup_p2p = static_pipeline_warmup


def run_pairs_with(schedule: Any, run_pair: Callable[[Callable[[], None], Callable[[], None]], None]) -> None:
    """DualPipeV's ``OVERLAP_F_B`` actions (a forward and a full backward of two micro-batches) run by
    ``run_pair(forward, backward)`` instead of one after the other: registered as the schedule's custom function for
    them (``_PipelineScheduleRuntime.register_custom_function``, torch 2.9+). Each part runs as torch's runtime runs a
    ``FORWARD`` and a ``FULL_BACKWARD`` (``_step_microbatches``' ``_perform_action``, torch 2.13): its receives waited
    for, the stage's chunk computed, the loss kept (forward outputs not kept: the runner's ``return_outputs=False``),
    the result handed to an adjacent stage of this rank. A schedule without such actions is left as it is."""
    from torch.distributed.pipelining import schedules

    if not isinstance(schedule, schedules._PipelineScheduleRuntime) or not any(
        a is not None and a.computation_type == schedules.OVERLAP_F_B for a in schedule.pipeline_order[schedule.rank]
    ):
        return

    def pair(action: Any, ctx: Any) -> None:
        run = ctx.schedule_ref
        by_index = {stage.stage_index: stage for stage in run._stages}
        fwd, bwd = action.sub_actions
        f_stage, b_stage = by_index[fwd.stage_index], by_index[bwd.stage_index]
        f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
        if not f_stage.is_first and f_stage.stage_index - 1 not in by_index:
            schedules._wait_batch_p2p(run.fwd_recv_ops.pop((f_stage.stage_index, f_mb)))
        if not b_stage.is_last and b_stage.stage_index + 1 not in by_index:
            schedules._wait_batch_p2p(run.bwd_recv_ops.pop((b_stage.stage_index, b_mb)))
        run._assert_unsharded(f_stage)
        run._assert_unsharded(b_stage)

        def forward() -> None:
            output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb], save_forward_output=False)
            run._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb)
            if f_stage.stage_index + 1 in by_index:
                by_index[f_stage.stage_index + 1].set_local_fwd_input(output, f_mb)

        def backward() -> None:
            loss = run._maybe_get_loss(b_stage, b_mb)
            run.backward_counter[b_stage.stage_index] += 1
            last = run.backward_counter[b_stage.stage_index] == run._n_microbatches
            b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)
            if b_stage.stage_index - 1 in by_index:
                by_index[b_stage.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb), b_mb)

        run_pair(forward, backward)

    schedule.register_custom_function(schedules.OVERLAP_F_B, pair)


@contextmanager
def param_group_nodes_observed(observe: Callable[[set], None]) -> Iterator[None]:
    """Inside, each time torch's ``stage_backward_input`` groups a stage's weights (its private ``get_param_groups``
    in ``torch.distributed.pipelining._backward``), ``observe`` gets the groups' intermediates: the autograd nodes
    that its weight pass (``stage_backward_weight``) runs again."""
    from torch.distributed.pipelining import _backward

    torch_groups = _backward.get_param_groups

    def observed(*args: Any, **kwargs: Any) -> list:
        groups = torch_groups(*args, **kwargs)
        observe({node for group in groups for node in group["intermediates"]})
        return groups

    _backward.get_param_groups = observed
    try:
        yield
    finally:
        _backward.get_param_groups = torch_groups


def full_backward_of(input_backward: Any) -> Any:
    """A pipeline schedule's input backward (``_Action`` of ``BACKWARD_INPUT``) as the full backward of the same stage
    and micro-batch (``FULL_BACKWARD``, torch 2.5+)."""
    from torch.distributed.pipelining import schedules

    return input_backward._replace(computation_type=schedules.FULL_BACKWARD)


def reorder_pipeline(schedule: Any, reorder: Callable[[list[Any]], list[Any]]) -> None:
    """A multi-stage schedule's compute actions on every rank replaced by ``reorder(actions)`` (its ``pipeline_order``
    of ``_Action`` or ``None``), and its communication lowered again from them (``_PipelineScheduleRuntime.
    _prepare_schedule_with_comms``, torch 2.5+, which the schedules' constructors call)."""
    order = {rank: reorder(list(actions)) for rank, actions in schedule.pipeline_order.items()}
    schedule.pipeline_order = order
    schedule._prepare_schedule_with_comms(order)


def pipeline_schedule_order(
    class_name: str, pp_size: int, num_microbatches: int, stages_per_rank: int,
    reorder: Callable[[list[Any]], list[Any]] = list,
) -> list[list[tuple[tuple[str, int, int], ...]]]:
    """The compute actions torch's multi-stage schedule ``class_name`` (of ``torch.distributed.pipelining.schedules``)
    runs on each of ``pp_size`` ranks, in order (its ``pipeline_order``, which its runtime executes): per action its
    parts ``(kind, stage, micro-batch)`` (``kind``: ``"F"``, ``"B"`` (full backward), ``"I"`` (input), ``"W"``
    (weight); DualPipeV's ``OVERLAP_F_B`` is its two parts). Built on mock stages, as torch's
    ``_schedule_visualizer.get_schedule_ops`` does (torch 2.6+), each rank's ``reorder``-ed as
    :func:`reorder_pipeline` does; other actions left out. (A single-stage schedule's ``pipeline_order`` is a
    drawing: its runtime follows its own loop.)"""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    order = get_schedule_ops(getattr(schedules, class_name), pp_size, num_microbatches, stages_per_rank)
    compute = ("F", "B", "I", "W")
    return [
        [tuple((p.computation_type.value, p.stage_index, p.microbatch_index) for p in (a.sub_actions or (a,)))
         for a in reorder(list(actions)) if a is not None and (a.sub_actions or a.computation_type.value in compute)]
        for actions in order
    ]


def resolve_process_group(name: str) -> Any:
    """The ``ProcessGroup`` a functional collective names (``distributed_c10d._resolve_process_group``, torch 2.3+)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def fake_store() -> Any:
    """A store for torch's fake process group (``torch.testing._internal.distributed.fake_pg.FakeStore``, torch 2.2+)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@contextmanager
def loss_parallel_backward_in_place() -> Iterator[None]:
    """Inside: the backward of torch's ``loss_parallel()`` cross-entropy (``tensor.parallel.loss.
    _nll_loss_and_log_softmax_backward``, torch 2.3+) computes the same values, ``(onehot + exp(log_probs)) *
    grad_output``, in one buffer of the logits' size (``exp``, then the one-hot added and the product taken in place),
    where torch's takes three at once (zeros, ``exp`` and their sum): two logits-sized temporaries less at the step's
    peak (the vocabulary-sharded logits, float32: 7.8 GiB each on the Llama-3.1-70B plan). The values are the same,
    bit for bit (the same additions and products, in the same order per element)."""
    from torch.distributed.tensor.parallel import loss

    torchs = loss._nll_loss_and_log_softmax_backward
    loss._nll_loss_and_log_softmax_backward = functools.partial(_log_softmax_nll_backward, loss)
    try:
        yield
    finally:
        loss._nll_loss_and_log_softmax_backward = torchs


def _log_softmax_nll_backward(
    loss: Any, grad_output: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: Any, reduction: int,
    ignore_index: int, total_weight: torch.Tensor, input_shape: Any, channel_dim: int, mesh: Any, mesh_dim: int,
) -> torch.Tensor:
    """torch's ``_nll_loss_and_log_softmax_backward`` (torch 2.13), its buffers reused (see above)."""
    channel_dim = 0 if x.dim() < 2 else 1
    if reduction == loss.Reduction.MEAN.value:
        grad_output = grad_output / total_weight
    target = target.unsqueeze(channel_dim)
    safe_target = torch.where(target != ignore_index, target, 0)
    grad_input = torch.exp(x)  # torch's: zeros here, exp(x) added at the end
    partial_placement = loss._MaskPartial(offset_shape=input_shape, offset_dim=channel_dim)
    masked_safe_target = partial_placement._partition_value(safe_target.squeeze(channel_dim).flatten(), mesh, mesh_dim)
    if partial_placement.mask_buffer.data is None:
        raise AssertionError("torch's _MaskPartial left no mask")
    grad_update = partial_placement.mask_buffer.data.to(grad_input.dtype) - 1.0  # -1 at a target on this rank, else 0
    rows = torch.arange(masked_safe_target.shape[0], device=masked_safe_target.device)
    if x.dim() == 1:
        grad_input[masked_safe_target] += grad_update
    elif x.dim() == 2:
        grad_input[rows, masked_safe_target] += grad_update
    else:
        grad_input_t = grad_input.transpose(channel_dim, -1)
        grad_input_2d = grad_input_t.reshape(-1, x.shape[channel_dim])
        grad_input_2d[rows, masked_safe_target] += grad_update
        grad_input = grad_input_2d.view(grad_input_t.shape).transpose(channel_dim, -1)
    if grad_input.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        new_shape = [1 for _ in range(x.dim())]
        new_shape[channel_dim] = weight.shape[0]
        weight = weight.reshape(new_shape)
        new_shape = list(x.shape)
        new_shape[channel_dim] = -1
        grad_output = grad_output * torch.gather(weight.expand(new_shape), channel_dim, target)
    grad_output = torch.where(target != ignore_index, grad_output, 0)
    if torch.result_type(grad_input, grad_output) != grad_input.dtype:
        return grad_input * grad_output  # a wider gradient: torch's product, out of place
    return grad_input.mul_(grad_output)
