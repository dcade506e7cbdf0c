"""Activation recomputation: what ``gradient_checkpointing`` may say, parsed once, applied to a model's blocks.

Contract: :meth:`Recompute.parse` takes what a user writes (Python or YAML) and returns a frozen, picklable
:class:`Recompute`, or raises ``ValueError`` naming what was given and listing what works:

* ``False`` / ``"none"``: nothing recomputed (every activation autograd saves is kept).
* ``True`` / ``"full"``: each block recomputed whole in backward (only its input kept).
* ``"full:<k>"`` (``k >= 1``): every k-th block (the k-th, 2k-th, ... counted over the model's blocks) recomputed
  whole, the others keep everything (torchtitan's layer-stride mode).
* ``"selective"``: torchtitan's op-level policy in every block: the outputs of attention kernels
  (``aten._scaled_dot_product_*``), of every other matrix product (``aten.mm`` / ``aten.addmm``, FP8's
  ``aten._scaled_mm``, counted per block),
  of ``aten.max`` and of reduce-scatters are kept; everything else is recomputed.
* ``{"recompute": [names...]}``: the ops run inside the named sub-modules of each block are recomputed, the
  outputs of every other op kept (torch's selective checkpointing: a kept op's output stays, the tensors a
  recomputed op's consumers need come back in backward). A name is a preset, ``"norm"`` (every module whose class
  name ends in ``Norm``: RMSNorm, LayerNorm) or ``"mla_up"`` (multi-head latent attention's up-projections:
  ``*q_b_proj``, ``*kv_b_proj`` of transformers, ``*wq_b``, ``*wkv_b`` of DeepSeek's code and the example, and what
  the attention makes of their outputs before its kernel: the module holding them runs under torch's selective
  checkpointing, keeping the attention kernel's outputs and the products outside the up-projections before it, the
  latents among them, and recomputing the rest, so that the kernel's inputs, q, k and v, are not kept), else an
  ``fnmatch`` pattern of a sub-module's name inside its block (``"attn.wkv_b"``, ``"*.kv_b_proj"``; ``*`` crosses
  dots). DeepSeek-V3's recipe is ``{"recompute": ["norm", "mla_up"]}``. A block with no such sub-module is left
  alone (nothing of it recomputed); one that is such a module itself is recomputed whole. :func:`recompute_blocks`
  raises when a name matches nothing in any block.

:func:`recompute_blocks` applies a mode to blocks in place (parameter names unchanged, applying twice is a no-op):
each chosen block's forward runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, with torch's
selective-checkpointing contexts and the mode's policy for the op-level modes, their kept outputs held for every
backward through the block (``compat.selective_checkpoint_contexts``: the zero-bubble schedules run two). Private
aten op names come from :mod:`lightning_ciuic.compat`. No Lightning imports.
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from lightning_ciuic import compat
from lightning_ciuic.compat import ATTENTION_OPS, SCALED_MM_OP

RecomputeMode = Literal["none", "full", "selective", "modules"]
GradientCheckpointing = Union[bool, str, dict[str, list[str]]]  # what users write (the strategy's argument type)
PRESETS = {"norm": "every module whose class name ends in 'Norm'",
           "mla_up": "multi-head latent attention's up-projections (*q_b_proj, *kv_b_proj, *wq_b, *wkv_b)"}
_MLA_UP = ("*q_b_proj", "*kv_b_proj", "*wq_b", "*wkv_b")
compat.profiler_ops_pass_selective_checkpointing()
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, SCALED_MM_OP)  # FP8's too
_SAVED_OPS = frozenset({*ATTENTION_OPS, torch.ops.aten.max.default,
                        compat.FUNCTIONAL_REDUCE_SCATTER})
_SPELLINGS = (
    "False or 'none' (keep every activation), True or 'full' (recompute each block), 'full:<k>' (every k-th block),"
    " 'selective' (torchtitan's op-level policy), or {'recompute': [names]} with presets"
    f" {sorted(PRESETS)} or fnmatch patterns of sub-module names inside a block (DeepSeek-V3's recipe:"
    " {'recompute': ['norm', 'mla_up']})"
)


@dataclass(frozen=True)
class Recompute:
    """One recomputation mode (see the module docstring); truthy unless nothing is recomputed."""

    mode: RecomputeMode = "none"
    every: int = 1  # "full": every k-th block
    modules: tuple[str, ...] = ()  # "modules": presets and patterns

    def __bool__(self) -> bool:
        return self.mode != "none"

    @classmethod
    def parse(cls, value: Any) -> "Recompute":
        """``value`` as written by a user (or a :class:`Recompute` already) -> a :class:`Recompute`."""
        if isinstance(value, Recompute):
            return value
        if isinstance(value, bool):
            return cls("full" if value else "none")
        if isinstance(value, str):
            if value in ("none", "full", "selective"):
                return cls(value)
            head, _, stride = value.partition(":")
            if head == "full" and stride.isdigit() and int(stride) >= 1:
                return cls("full", every=int(stride))
        elif isinstance(value, Mapping) and list(value) == ["recompute"]:
            names = value["recompute"]
            if isinstance(names, str):
                names = [names]
            if isinstance(names, Sequence) and names and all(isinstance(n, str) and n for n in names):
                return cls("modules", modules=tuple(names))
        raise ValueError(f"gradient_checkpointing={value!r} is not a recomputation mode: use {_SPELLINGS}.")

    def __str__(self) -> str:
        if self.mode == "full" and self.every > 1:
            return f"full:{self.every}"
        return f"{{'recompute': {list(self.modules)}}}" if self.mode == "modules" else self.mode


def recompute_blocks(blocks: Sequence[nn.Module], recompute: Recompute, block_names: Optional[Sequence[str]] = None) -> None:
    """Apply ``recompute`` to ``blocks`` in place (``block_names``: their names, for errors; default ``block<i>``)."""
    names = list(block_names) if block_names is not None else [f"block{i}" for i in range(len(blocks))]
    if recompute.mode == "full":
        checkpoint_activations([b for i, b in enumerate(blocks, start=1) if i % recompute.every == 0])
    elif recompute.mode == "selective":
        checkpoint_activations(blocks, _selective_context)
    elif recompute.mode == "modules":
        _recompute_modules(blocks, names, recompute.modules)


def module_matches(name: str, module: nn.Module, entry: str) -> bool:
    """Whether the sub-module ``name`` (relative to its block) is what ``entry`` (a preset or pattern) names."""
    if entry == "norm":
        return type(module).__name__.endswith("Norm")
    patterns = _MLA_UP if entry == "mla_up" else (entry,)
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _recompute_modules(blocks: Sequence[nn.Module], block_names: Sequence[str], entries: Sequence[str]) -> None:
    used: set[str] = set()

    def named(name: str, module: nn.Module) -> bool:
        hits = {e for e in entries if module_matches(name, module, e)}
        used.update(hits)
        return bool(hits)

    whole, partly, attentions = [], [], []
    for block in blocks:
        if named("", block):
            whole.append(block)
            continue
        parents: dict[str, list[nn.Module]] = defaultdict(list)  # an attention -> its up-projections
        for n, m in block.named_modules():
            if n and "mla_up" in entries and module_matches(n, m, "mla_up"):
                parents[n.rpartition(".")[0]].append(m)
        attentions += [(block.get_submodule(p), ups) for p, ups in parents.items()]
        held = [block.get_submodule(p) for p in parents if p]  # their modules recomputed inside the attention's
        inside = [m for n, m in block.named_modules() if n and named(n, m) and not any(_contains(a, m) for a in held)]
        if inside and not isinstance(block.__dict__.get("forward"), _OutputsDropped):  # else applied already
            partly.append((block, inside))
    unused = [e for e in entries if e not in used]
    if unused:
        sample = [n for b in blocks[:3] for n, _ in b.named_modules() if n][:8]
        raise ValueError(
            f"gradient_checkpointing={{'recompute': {list(entries)}}}: {unused} name no sub-module of any block of"
            f" {list(block_names)[:4]}{'...' if len(block_names) > 4 else ''} (names inside a block look like {sample});"
            f" use presets {sorted(PRESETS)} or fnmatch patterns of those names."
        )
    checkpoint_activations(whole)
    for attention, ups in attentions:
        if not isinstance(attention.__dict__.get("forward"), _Recomputed):
            attention.forward = _Recomputed(attention.forward, _attention_inputs_recomputed(ups))
    for block, inside in partly:
        outputs: dict[int, tuple[torch.Tensor, _Output]] = {}
        block.forward = _OutputsDropped(block.forward, outputs)
        outermost = [m for m in inside if not any(m is not o and _contains(o, m) for o in inside)]
        for module in outermost:
            module.forward = _RecomputedModule(module.forward, outputs)


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


class _Output:
    """A recomputed sub-module's output: its forward and inputs (which its checkpoint keeps anyway) and the
    autocast state it ran under; the value computed again (once) when backward first asks for it."""

    def __init__(self, forward: Callable[..., Any], args: tuple, kwargs: dict, device_type: str) -> None:
        self.forward, self.args, self.kwargs, self.device_type = forward, args, kwargs, device_type
        self.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        self._value: Optional[torch.Tensor] = None

    def value(self) -> torch.Tensor:
        if self._value is None:
            enabled, dtype = self.autocast
            with torch.no_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled):
                self._value = self.forward(*self.args, **self.kwargs)
        return self._value


class _Dropped:
    """What autograd keeps instead of a tensor that is (a view of) a recomputed sub-module's output."""

    def __init__(self, output: _Output, geometry: Optional[tuple]) -> None:
        self.output, self.geometry = output, geometry

    def unpack(self) -> torch.Tensor:
        value = self.output.value()
        if self.geometry is None:
            return value
        size, stride, offset = self.geometry
        return value.as_strided(size, stride, value.storage_offset() + offset)


class _RecomputedModule:
    """A sub-module's forward recomputed in backward: its own saved tensors dropped (a checkpoint over it, which
    keeps its inputs) and its output noted in its block's ``outputs``, so that its consumers do not keep it."""

    def __init__(self, forward: Callable[..., Any], outputs: dict) -> None:
        self.forward, self.outputs = forward, outputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        out = checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        if isinstance(out, torch.Tensor) and compat.view_base(out) is None:
            self.outputs[id(out)] = (out, _Output(self.forward, args, kwargs, out.device.type))
        return out


class _OutputsDropped:
    """A block's forward under saved-tensor hooks that keep, instead of a recomputed sub-module's output (or a view
    of it, but a DTensor's), how to compute it again; every other saved tensor is kept as autograd keeps it."""

    def __init__(self, forward: Callable[..., Any], outputs: dict) -> None:
        self.forward, self.outputs = forward, outputs

    def pack(self, tensor: torch.Tensor) -> Any:
        base = compat.view_base(tensor)
        root = tensor if base is None else base
        entry = self.outputs.get(id(root))
        if entry is None or entry[0] is not root:
            return tensor.detach()
        if base is None:
            return _Dropped(entry[1], None)
        if isinstance(tensor, DTensor):  # a view of a DTensor is no strided view of its local shard: kept
            return tensor.detach()
        return _Dropped(entry[1], (tensor.size(), tensor.stride(), tensor.storage_offset() - root.storage_offset()))

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.unpack() if isinstance(packed, _Dropped) else packed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return self.forward(*args, **kwargs)
        finally:
            self.outputs.clear()


def _selective_context() -> Any:
    """torchtitan's op-level policy, with its own count of matrix products (the forward's and the recompute's)."""
    counts: dict[bool, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return compat.selective_checkpoint_contexts(policy)


def _attention_inputs_recomputed(ups: Sequence[nn.Module]) -> Callable[[], Any]:
    """Selective-checkpointing contexts for an attention whose up-projections are ``ups``: the attention kernels'
    outputs kept, and the products run outside ``ups`` before the first kernel (the latents' down-projections); the
    rest recomputed (the up-projections, the rotary embedding, the norms: the kernel's inputs)."""
    inside = [0]  # calls of an up-projection running now (its forward hooks count them, forward and recompute)

    def enter(*_: Any) -> None:
        inside[0] += 1

    def leave(*_: Any) -> None:
        inside[0] -= 1

    for up in ups:
        up.register_forward_pre_hook(enter)
        up.register_forward_hook(leave)

    def context() -> Any:
        past_kernel = {False: False, True: False}  # per forward and recompute

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in ATTENTION_OPS:
                past_kernel[ctx.is_recompute] = True
                return CheckpointPolicy.MUST_SAVE
            if func in _MATMULS and not inside[0] and not past_kernel[ctx.is_recompute]:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return compat.selective_checkpoint_contexts(policy)

    return context


class _Recomputed:
    """A block's forward whose activations are recomputed in backward instead of kept (when grads are on);
    ``context_fn``: torch's selective-checkpointing contexts (``None``: recompute everything)."""

    def __init__(self, forward: Callable[..., Any], context_fn: Optional[Callable[[], Any]] = None) -> None:
        self.forward, self.context_fn = forward, context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        if self.context_fn is None:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)


def checkpoint_activations(blocks: Sequence[nn.Module], context_fn: Optional[Callable[[], Any]] = None) -> None:
    """Activation checkpointing per block, in place (parameter names unchanged); applying it twice is a no-op."""
    for block in blocks:
        if not isinstance(block.__dict__.get("forward"), _Recomputed):
            block.forward = _Recomputed(block.forward, context_fn)
