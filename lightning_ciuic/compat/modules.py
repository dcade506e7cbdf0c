"""Private parts of autograd, ``nn.Module``, torch's ops and transformers' models the pack touches (see
:mod:`lightning_ciuic.compat`): the current graph task, forward-hook tables, ``torch._grouped_mm``, transformers'
experts implementation and its models' tensor- and pipeline-parallel plans; the attention kernels' aten ops
(``ATTENTION_OPS``), the profiler ops passed through selective checkpointing, selective checkpointing's storage kept for
a second backward (``selective_checkpoint_contexts``), a view's base (``view_base``)."""

from __future__ import annotations

import functools
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch


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


# The functional reduce-scatter (``torch.ops._c10d_functional``, a private op namespace: DTensor's and FSDP2's), whose
# output selective recomputation keeps rather than running the collective again.
FUNCTIONAL_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


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


def selective_checkpoint_contexts(policy: Any) -> tuple[Any, Any]:
    """torch's ``create_selective_checkpoint_contexts(policy)``, whose kept outputs stay for every backward through the
    region (until autograd frees its graph) instead of one: a zero-bubble schedule (``zbv_zero_bubble``,
    ``dualpipev``, ...) runs backward through a region twice, the inputs' gradients then the weights', and torch marks
    an entry consumed in the first ("Trying to backward an extra time"). The contexts' shared ``storage`` (private) is
    replaced by one whose entries keep their first value."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    caching, cached = create_selective_checkpoint_contexts(policy)
    caching.storage = cached.storage = defaultdict(_FirstValueKept)
    return caching, cached


class _FirstValueKept(dict):
    """A selective-checkpointing storage's entries of one op: written once in forward, never overwritten (the
    recompute's "consumed" mark is dropped)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self:
            super().__setitem__(key, value)


class RecomputationShared:
    """One checkpointed graph's backward run in two calls (a zero-bubble schedule's input pass, then its weight pass),
    each region recomputed once for both.

    torch's non-reentrant checkpoint recomputes a region once per backward call (its graph task), storing every tensor
    the region saved whose node is alive, and frees one when a node of that call unpacks it. The input pass keeps the
    graph, so the weight pass recomputed each region again, and held all of it (the input pass's nodes keep their
    saved tensors) until it ended: 3 GiB a DeepSeek-V3 layer at 4096 tokens, besides the compute.

    Inside :meth:`first_call`, the tensors unpacked by a node of ``again`` (the nodes the second call runs again,
    :func:`~lightning_ciuic.compat.distributed.param_group_nodes_observed`) stay recomputed; inside
    :meth:`second_call`, an unpack takes what the first call recomputed (once: it is let go there), else recomputes as
    torch does (a node the second call runs that is not in ``again``: torch's weight pass runs the input pass's nodes
    between two intermediates of one weight group again, a weight read twice in a region). Outside both, torch's
    behaviour. Regions are shared only when their forward ran after :func:`share_recomputations` (a pipeline stage's
    set-up calls it)."""

    def __init__(self) -> None:
        self.again: set = set()  # autograd nodes
        self._first_tasks: set[int] = set()

    @contextmanager
    def first_call(self) -> Iterator[None]:
        try:
            with _sharing(self, first=True):
                yield
        finally:
            self.again.clear()  # the nodes are the graph's: held here, they would keep it past the second call

    @contextmanager
    def second_call(self) -> Iterator[None]:
        with _sharing(self, first=False):
            yield

    def unpack(self, frame: Any, holder: Any, torch_unpack: Any, first: bool) -> torch.Tensor:
        from torch.utils.checkpoint import _Handle

        if not first:
            for task in self._first_tasks:
                handle = holder.handles.get(task)
                if handle is not None and handle in frame.recomputed[task]:
                    holder.handles[task] = None
                    return frame.recomputed[task].pop(handle)
            return torch_unpack(holder)
        task = torch._C._current_graph_task_id()
        value = torch_unpack(holder)
        self._first_tasks.add(task)
        if torch._C._current_autograd_node() in self.again:
            holder.handles[task] = _Handle()
            frame.recomputed[task][holder.handles[task]] = value
        return value


_SHARING: list[tuple[RecomputationShared, bool]] = []  # not thread-local: CUDA's backward runs on autograd's threads


@contextmanager
def _sharing(share: RecomputationShared, first: bool) -> Iterator[None]:
    _SHARING.append((share, first))
    try:
        yield
    finally:
        _SHARING.pop()


@functools.cache
def share_recomputations() -> None:
    """From now on, torch's non-reentrant checkpoint (its private ``_checkpoint_hook``: a region's saved-tensor hooks)
    unpacks through the :class:`RecomputationShared` in force, if any; once per process."""
    from torch.utils import checkpoint as torch_checkpoint

    class SharingCheckpointHook(torch_checkpoint._checkpoint_hook):
        def __init__(self, frame: Any) -> None:
            super().__init__(frame)
            torch_unpack = self.unpack_hook

            def unpack(holder: Any) -> torch.Tensor:
                if not _SHARING:
                    return torch_unpack(holder)
                share, first = _SHARING[-1]
                return share.unpack(frame, holder, torch_unpack, first)

            self.unpack_hook = unpack

    torch_checkpoint._checkpoint_hook = SharingCheckpointHook


def view_base(tensor: torch.Tensor) -> Any:
    """The tensor ``tensor`` is a view of (autograd's ``_base``, a private attribute: the root, for a view of a view),
    else ``None``."""
    return tensor._base


def saved_tensors_hooks_outside() -> Optional[tuple]:
    """The innermost saved-tensor hooks in force, ``(pack, unpack)``, or ``None`` (autograd's private
    ``_top_saved_tensors_default_hooks``): what a context of hooks inside passes the tensors it leaves alone to."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def is_torch_checkpoint_hook(hooks: Optional[tuple]) -> bool:
    """Whether ``hooks`` (:func:`saved_tensors_hooks_outside`) are torch's activation checkpointing's (plain or
    selective), whose saved tensors are dropped and recomputed: their pack functions are defined in
    ``torch.utils.checkpoint``."""
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


# FP8's matrix product (private aten op, torch 2.1+): selective recomputation counts it as a matrix product
# (parallel/recompute.py) and the planner's FLOP count apart (planner/flops.py).
SCALED_MM_OP = torch.ops.aten._scaled_mm.default


def scaled_mm(
    a_codes: torch.Tensor, b_codes: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``torch._scaled_mm`` (private op, torch 2.1+): ``(a_codes * a_scales) @ (b_codes * b_scales)`` of float8 codes
    (``a`` row-major, ``b`` column-major), the scales float32 (``[M, 1]`` and ``[1, N]``: a scale per row of ``a``
    and per column of ``b``), accumulated in float32, in ``out_dtype``."""
    return torch._scaled_mm(a_codes, b_codes, scale_a=a_scales, scale_b=b_scales, out_dtype=out_dtype)


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (private op, torch 2.8+)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(rows, weights, offs=offsets)`` (private op, torch 2.8+): row group ``g`` (ending at
    ``offsets[g]``) times ``weights[g]``: the experts' grouped GEMM."""
    return torch._grouped_mm(rows, weights, offs=offsets)


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


def hugging_face_tp_plan(model: Any) -> Any:
    """A transformers model's tensor-parallel plan (``PreTrainedModel._tp_plan``, transformers 4.50+); None if none."""
    return getattr(model, "_tp_plan", None)


def hugging_face_pp_plan(model: Any) -> Any:
    """A transformers model's pipeline plan (``PreTrainedModel._pp_plan``, transformers 4.50+); None if none."""
    return getattr(model, "_pp_plan", None)
