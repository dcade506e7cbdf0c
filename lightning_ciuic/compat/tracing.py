"""The private parts of torch (and transformers) the planner's fake step touches (see :mod:`lightning_ciuic.compat`):
dispatch modes (and a thread's stack of them, handed to a helper thread), fake tensors and their rules, DTensor's shape
propagation, ``MemTracker``, ops' overload packets and the FLOP formulas of private ops, the CPU's attention kernels as CUDA runs them, transformers' packed-sequence check."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported: dispatch modes, torch 2.0+)


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


def dispatch_modes() -> list[Any]:
    """This thread's ``TorchDispatchMode`` stack, innermost last (infra modes, fake tensors', included; torch 2.1+)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()


def push_dispatch_modes(modes: list[Any]) -> None:
    """Push ``modes`` (another thread's :func:`dispatch_modes`) onto this thread's stack, as they are: none is entered
    again (``__enter__`` would start them over). For a helper thread, whose stack dies with it."""
    for mode in modes:
        torch._C._push_on_torch_dispatch_stack(mode)


def overload_packet(func: Any) -> Any:
    """The overload packet (``torch.ops.aten.mm``) of an op overload (``torch.ops.aten.mm.default``), as dispatch
    modes see ops: ``OpOverload._overloadpacket`` (torch 2.0+)."""
    return func._overloadpacket


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (or a view of one): metadata, no data (``torch._subclasses.fake_tensor.
    is_fake``, torch 2.1+)."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return bool(_is_fake(tensor))


def fake_tensor_mode(**kwargs: Any) -> Any:
    """torch's ``FakeTensorMode`` (``torch._subclasses.fake_tensor``, torch 2.0+): tensors with metadata, no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def private_op_flop_formulas(grouped_mm_flops: Any) -> dict[Any, Any]:
    """FLOP formulas of private aten ops torch's flop counter lacks (torch 2.13): ``aten._grouped_mm`` (``
    grouped_mm_flops``) and the CPU's flash attention and its backward (the counter's flash-attention formulas)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    return {
        aten._grouped_mm: grouped_mm_flops,
        aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            flop_registry[aten._scaled_dot_product_flash_attention_backward],
    }
