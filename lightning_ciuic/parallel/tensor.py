"""Tensor-parallel plans, validated before they are applied.

Contract: ``apply_tensor_parallel(module, tp_mesh, plan)`` checks that every ``nn.Linear`` the plan
shards splits evenly (``ColwiseParallel``: ``out_features % tp == 0``; ``RowwiseParallel``:
``in_features % tp == 0``; ``nn.Embedding`` likewise on its sharded dimension) and then calls
``torch.distributed.tensor.parallel.parallelize_module``. A plan entry that matches no sub-module is an
error too: a typo in a plan must not silently leave a layer unsharded. With a mesh of size 1 the module
is returned untouched, so one LightningModule runs with and without tensor parallelism.

``sum_grad_over(activation, tp_mesh)`` is Megatron's "copy to tensor-parallel region": identity forward,
gradient summed over the ``tp`` axis backward. Use it where a replicated activation feeds rank-local
computation outside a parallelized module (e.g. MLA's rotary key shared by all heads), or the replicated
weights that produced it receive only this rank's share of the gradient and the replicas drift apart.

``hugging_face_plan(model, plan)`` translates a Hugging Face ``base_model_tp_plan`` / ``_tp_plan`` (patterns
where ``*`` stands for a layer index, styles as strings) into concrete module names and torch styles:
``colwise`` and ``rowwise`` on ``nn.Linear`` become ``ColwiseParallel`` / ``RowwiseParallel``,
``colwise_gather_output`` (alias ``colwise_rep``) a ``ColwiseParallel`` with a replicated output,
``rowwise_split_input`` (alias ``rowwise_rep``: Phi-3's, GLM's, OLMo-2's projection after a gathered one) a
``RowwiseParallel`` that splits its replicated input, ``embedding_rowwise``
on ``nn.Embedding`` a ``RowwiseParallel`` (vocabulary-parallel embedding), ``mla_kv_a_proj`` (multi-head latent
attention's ``kv_a_proj_with_mqa``) :class:`SharedRotaryKey`. The styles of :data:`KEPT_REPLICATED_STYLES` (packed
3-D expert weights and expert-parallel wrappers, which the expert-parallel layer handles, sequence-parallel norms,
``replicate``), and entries whose pattern names a parameter rather than a module, are returned as *skipped*: those
modules stay replicated, which is correct, only not sharded. Any other style on a module is refused, naming the entry:
kept replicated, a module its neighbours expect sharded (or reduced) would compute something else than the plan.
``replicated_with_grad_allreduce`` (Qwen3's and Gemma3's per-head ``q_norm`` /
``k_norm``, which see only a rank's heads, so each rank's gradient is a part that must be summed over tp) becomes
:class:`HeadwiseReplicated`: the module's parameters replicated DTensors, its input this rank's heads as a DTensor
sharded on the heads dimension, so DTensor's backward returns the parameters' gradient as ``Partial`` (each rank's
heads' part), redistributed to the parameter's ``Replicate`` (summed over tp) by the hook below, or by FSDP2.
:class:`SharedRotaryKey` keeps its module replicated and sums over tp the gradient of its output's last
``qk_rope_head_dim`` features: MLA's rotary key, which reaches every head directly instead of through the
column-parallel ``kv_b_proj`` (whose input gradient ``ColwiseParallel`` sums), so each rank holds its heads' part only.

``gradients_in_parameter_placements(module)`` keeps each DTensor parameter's gradient in its parameter's placements
once accumulated (a post-accumulate-grad hook): DTensor's backward may return another (a vocabulary-sharded
embedding's comes back ``Replicate``: the whole table on every tp rank, tp times its shard's memory; a
:class:`HeadwiseReplicated` norm's ``Partial``), and the optimizer, gradient clipping and the data-parallel engines
need the parameter's own shard. From ``Replicate`` to a shard is a local slice; from ``Partial``, a sum over tp.
``parallelize`` applies it where FSDP2 does not shard the module (FSDP2 redistributes its unsharded gradients itself).

Sequence and loss parallelism (the strategy's ``sequence_parallel``, on by default under tp): the residual stream
between the tensor-parallel linears (embedding output, norms, residual adds) holds ``1/tp`` of the sequence
(``Shard(1)``). The styles a plan builds it from, torchtitan's: :func:`scattered_output` (a replicated module's output
cut to this rank's part of the sequence), torch's ``SequenceParallel`` (norms: parameters replicated, the gradient each
rank's sequence gives summed over tp), :func:`gathered_input` (an attention or feed-forward gathers the sequence and
its row-parallel output projection reduce-scatters it back: ``RowwiseParallel(output_layouts=Shard(1))``; the gathered
tensor is recorded while the module runs, so that its column-parallel linears, :class:`~lightning_ciuic.parallel.regather.
ColwiseSavingShard`, keep this rank's part for backward, as Megatron-LM's do: :mod:`~lightning_ciuic.parallel.regather`),
:func:`gathered_input_scattered_output` (a module whose output is whole on every rank, e.g. a mixture of experts routing
the gathered sequence), and :func:`vocabulary_sharded_head` (the LM head gathers the sequence and keeps its logits a
DTensor sharded on the vocabulary). Those logits' cross-entropy is computed from the shards inside torch's
``loss_parallel()`` (:func:`loss_parallel_context`, which the strategy enters around each step and its backward; its
backward in one logits-sized buffer: ``compat.loss_parallel_backward_in_place``);
inside it, :class:`PlainLosses` hands the replicated DTensor loss back as a plain tensor (:func:`local_loss`, its
gradient still flowing), so a user's ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())``, ``self.log`` and
the step's output work unchanged; anything else mixing the sharded logits with plain tensors fails naming the fix.

No Lightning imports.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from lightning_ciuic import compat
from lightning_ciuic.parallel.regather import (
    ColwiseSavingShard,
    ReplicatedSavingShard,
    forget_gathered,
    record_gathered,
    save_shard_when_replicated,
)


def _sharded_dimension(module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """The (name, size) of the dimension ``style`` splits on ``module``, or None if it splits none we know."""
    if isinstance(module, nn.Linear):
        if isinstance(style, ColwiseParallel):
            return "out_features", module.out_features
        if isinstance(style, RowwiseParallel):
            return "in_features", module.in_features
    if isinstance(module, nn.Embedding):
        if isinstance(style, ColwiseParallel):
            return "embedding_dim", module.embedding_dim
        if isinstance(style, RowwiseParallel):
            return "num_embeddings", module.num_embeddings
    return None


def validate_tensor_parallel_plan(module: nn.Module, tp_size: int, plan: Mapping[str, ParallelStyle]) -> None:
    """Raise ``ValueError`` naming the layer, its dimension and the valid sizes if ``plan`` cannot split evenly."""
    names = dict(module.named_modules())
    for pattern, style in plan.items():
        matches = [name for name in names if name and fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r} matches no sub-module of {type(module).__name__};"
                f" sub-module names look like {sorted(n for n in names if n)[:5]}."
            )
        for name in matches:
            dim = _sharded_dimension(names[name], style)
            if dim is not None and dim[1] % tp_size != 0:
                valid = [d for d in range(1, dim[1] + 1) if dim[1] % d == 0 and d <= 64]
                raise ValueError(
                    f"tensor_parallel_size={tp_size} does not divide {name}.{dim[0]}={dim[1]}"
                    f" ({type(style).__name__}); use a tensor_parallel_size that divides it, e.g. one of {valid}."
                )


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> nn.Module:
    """Validate ``plan`` for ``tp_mesh.size()`` and apply it in place; a no-op when the mesh has one rank."""
    tp_size = tp_mesh.size()
    if tp_size == 1:
        return module
    validate_tensor_parallel_plan(module, tp_size, plan)
    return parallelize_module(module, tp_mesh, dict(plan))


def gradients_in_parameter_placements(module: nn.Module) -> None:
    """Keep every DTensor parameter's accumulated gradient in its placements (see the module docstring).

    Each parameter's hook is (re)registered by a forward pre-hook of the module owning it, on the module's calls:
    materialising a meta-built module (``to_empty``) swaps its parameters' contents, hooks included, after this ran."""
    for sub in module.modules():
        if any(isinstance(p, DTensor) for p in sub.parameters(recurse=False)):
            sub.register_forward_pre_hook(_hook_gradients)


def _hook_gradients(module: nn.Module, args: object) -> None:
    for param in module.parameters(recurse=False):
        if isinstance(param, DTensor) and param.requires_grad and not getattr(param, "_grad_placement_hooked", False):
            param.register_post_accumulate_grad_hook(gradient_to_parameter_placements)
            param._grad_placement_hooked = True  # swapped away with the hook


@torch.no_grad()
def gradient_to_parameter_placements(param: torch.Tensor) -> None:
    """``param.grad`` redistributed to ``param``'s placements where a DTensor's differ (the hook's work; the replicated
    engine's gradient hook, which may run before it, calls it too)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def sum_grad_over(activation: torch.Tensor, tp_mesh: DeviceMesh | None) -> torch.Tensor:
    """Identity forward; backward all-reduces (sums) the gradient over ``tp_mesh``. No-op without TP."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return activation
    replicated = DTensor.from_local(activation, tp_mesh, [Replicate()], run_check=False)
    return replicated.to_local(grad_placements=[Partial()])


SEQUENCE = Shard(1)  # the residual stream's layout under sequence parallelism: [batch, sequence/tp, hidden]


class SequenceLayout(ParallelStyle):
    """Moves a module's hidden states between the whole sequence (``Replicate``) and this rank's part (``Shard(1)``):
    ``input=(from, to)`` on its first positional argument, or its ``hidden_states`` keyword (Hugging Face layers and
    attentions take it so), ``output=(from, to)`` on its output (a tuple's first item). DTensor redistributes, so the
    backward is the matching collective (a gathered input's gradient scattered back, a scattered output's gathered)."""

    def __init__(self, input: Optional[tuple] = None, output: Optional[tuple] = None) -> None:
        super().__init__()
        self.input, self.output = input, output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.input is not None:
            module.register_forward_pre_hook(partial(self._move_input, device_mesh), with_kwargs=True)
        if self.input == (SEQUENCE, Replicate()):  # the gathered input recorded while the module runs (regather.py)
            module.register_forward_hook(self._forget_gathered, with_kwargs=True, always_call=True)
        if self.output is not None:
            module.register_forward_hook(partial(self._move_output, device_mesh))
        return module

    def _move(self, tensor: torch.Tensor, mesh: DeviceMesh, layouts: tuple) -> torch.Tensor:
        source, target = layouts
        local = tensor
        if not isinstance(tensor, DTensor):
            tensor = DTensor.from_local(tensor, mesh, [source], run_check=False)
        moved = tensor.redistribute(mesh, [target]).to_local()
        if layouts == (SEQUENCE, Replicate()) and local is not tensor and self.input == layouts:
            record_gathered(moved, local, mesh, SEQUENCE.dim)
        return moved

    def _move_input(self, mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        if args:
            return (self._move(args[0], mesh, self.input), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise ValueError(
                f"{type(module).__name__} is planned to take its hidden states sequence-parallel, and was called without"
                f" positional arguments or a hidden_states keyword (keywords: {sorted(kwargs)})."
            )
        return args, {**kwargs, "hidden_states": self._move(kwargs["hidden_states"], mesh, self.input)}

    @staticmethod
    def _forget_gathered(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        forget_gathered(args[0] if args else kwargs.get("hidden_states"))

    def _move_output(self, mesh: DeviceMesh, module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (self._move(output[0], mesh, self.output), *output[1:])
        return self._move(output, mesh, self.output)


def scattered_output() -> ParallelStyle:
    """A replicated module (e.g. the token embedding) whose whole output each rank cuts to its part of the sequence."""
    return SequenceLayout(output=(Replicate(), SEQUENCE))


def scattered_input() -> ParallelStyle:
    """A module (the first decoder layer) whose whole input each rank cuts to its part of the sequence."""
    return SequenceLayout(input=(Replicate(), SEQUENCE))


def gathered_input() -> ParallelStyle:
    """A module between the sequence-parallel norms (attention, MLP) that gathers its sequence-sharded input."""
    return SequenceLayout(input=(SEQUENCE, Replicate()))


def gathered_input_scattered_output() -> ParallelStyle:
    """A module run on the gathered sequence whose output is whole on every rank, cut back to this rank's part."""
    return SequenceLayout(input=(SEQUENCE, Replicate()), output=(Replicate(), SEQUENCE))


def vocabulary_sharded_head(input_layout: Any = SEQUENCE) -> ParallelStyle:
    """The LM head: column-parallel, its logits kept a DTensor sharded on the vocabulary (loss parallelism)."""
    return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Where ``enabled``: torch's ``loss_parallel()`` (the cross-entropy of vocabulary-sharded DTensor logits computed
    from the shards, forward and backward) and :class:`PlainLosses` (that loss handed back a plain tensor). Plain
    tensors are unaffected."""
    if not enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(loss_parallel())
    stack.enter_context(compat.loss_parallel_backward_in_place())  # the same gradient, two logits-sized buffers fewer
    stack.enter_context(PlainLosses())
    return stack


SHARDED_LOGITS_ADVICE = (
    "Under tensor_parallel_size > 1 with sequence_parallel=True (the default) the model's logits are a DTensor sharded"
    " on the vocabulary, and their loss is computed from the shards by F.cross_entropy / nn.CrossEntropyLoss (torch's"
    " loss_parallel). Compute the loss with one of them, call .full_tensor() on the logits for anything else (which"
    " gathers the vocabulary), or pass sequence_parallel=False to the strategy."
)


class PlainLosses(TorchFunctionMode):
    """``F.cross_entropy`` / ``F.nll_loss`` of DTensor inputs return the plain tensor each rank holds
    (:func:`local_loss`), so a step's loss, what it logs and what it returns are ordinary tensors; an operation mixing
    the sharded logits with a plain tensor (which DTensor refuses) fails saying what works instead."""

    LOSSES = frozenset({F.cross_entropy, F.nll_loss})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        try:
            result = func(*args, **(kwargs or {}))
        except RuntimeError as err:
            if "mixed torch.Tensor and DTensor" in str(err) and "loss_parallel" not in str(err):
                raise RuntimeError(f"{err} {SHARDED_LOGITS_ADVICE}") from err
            raise
        return local_loss(result) if func in self.LOSSES else result


def local_loss(loss: Any) -> Any:
    """A DTensor loss (replicated: torch's parallel cross-entropy) as the plain tensor each rank holds, in a step's
    output (a tensor, or a mapping's values: Lightning's ``{"loss": ...}``); anything else as given. The gradient
    flows back through it."""
    if isinstance(loss, Mapping):
        return {key: local_loss(value) for key, value in loss.items()}
    if isinstance(loss, DTensor):
        if any(not p.is_replicate() for p in loss.placements):
            loss = loss.redistribute(loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
        return loss.to_local()
    return loss


class HeadwiseReplicated(ParallelStyle):
    """A module run on this rank's heads alone (input ``[..., heads, head_dim]``, the heads split over tp by the
    column-parallel projection before it): parameters replicated over tp, gradients summed over tp (see the module
    docstring). Its output is local again, as the input came."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._heads_in, output_fn=self._local_out)

    @staticmethod
    def _heads_in(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        heads, *rest = inputs
        if heads.dim() < 2:
            raise ValueError(
                f"{type(module).__name__} is planned replicated_with_grad_allreduce, for per-head inputs"
                f" [..., heads, head_dim], and got a {heads.dim()}-D input of shape {tuple(heads.shape)}."
            )
        return (DTensor.from_local(heads, device_mesh, [Shard(heads.dim() - 2)], run_check=False), *rest)

    @staticmethod
    def _local_out(module: nn.Module, output: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()


class SharedRotaryKey(ParallelStyle):
    """MLA's ``kv_a_proj_with_mqa`` (output ``[compressed kv | rotary key]``): parameters replicated, the rotary key's
    gradient summed over tp (see the module docstring)."""

    def __init__(self, rotary_dim: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sum_rotary_key_gradient(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            compressed, rotary = output.split([output.shape[-1] - self.rotary_dim, self.rotary_dim], dim=-1)
            return torch.cat([compressed, sum_grad_over(rotary, device_mesh)], dim=-1)

        module.register_forward_hook(sum_rotary_key_gradient)
        save_shard_when_replicated(module)  # a gathered input (sequence parallelism): the rank's part kept (regather.py)
        return module


# Hugging Face styles whose modules stay replicated, correctly: expert weights and wrappers (the expert-parallel layer
# shards and dispatches experts itself), norms planned sequence-parallel (this translation keeps activations
# replicated between the tensor-parallel linears), and plain replication.
KEPT_REPLICATED_STYLES = frozenset(
    {"packed_colwise", "packed_rowwise", "moe_tp_experts", "grouped_gemm", "ep_dispatch_experts", "sequence_parallel",
     "replicate"}
)


def _rotary_key(config: Any) -> ParallelStyle | None:
    rotary_dim = getattr(config, "qk_rope_head_dim", None)
    return SharedRotaryKey(rotary_dim) if rotary_dim else None


# Hugging Face style -> (the module type it applies to, its torch style from the model's config; None: not translated)
_TRANSLATIONS: dict[str, tuple[type[nn.Module], Callable[[Any], ParallelStyle | None]]] = {
    "colwise": (nn.Linear, lambda config: ColwiseParallel()),
    "rowwise": (nn.Linear, lambda config: RowwiseParallel()),
    "colwise_gather_output": (nn.Linear, lambda config: ColwiseParallel(output_layouts=Replicate())),
    "colwise_rep": (nn.Linear, lambda config: ColwiseParallel(output_layouts=Replicate())),
    # a replicated input (after a gathered colwise), split here
    "rowwise_split_input": (nn.Linear, lambda config: RowwiseParallel(input_layouts=Replicate())),
    "rowwise_rep": (nn.Linear, lambda config: RowwiseParallel(input_layouts=Replicate())),
    "mla_kv_a_proj": (nn.Linear, _rotary_key),
    "embedding_rowwise": (nn.Embedding, lambda config: RowwiseParallel(input_layouts=Replicate())),  # token ids replicated
    "replicated_with_grad_allreduce": (nn.Module, lambda config: HeadwiseReplicated()),
}


def hugging_face_plan(
    model: nn.Module, plan: Mapping[str, str], prefix: str = "", sequence_parallel: bool = False
) -> tuple[dict[str, ParallelStyle], list[str]]:
    """``(torch plan over concrete module names, skipped "pattern: style" entries)`` for a Hugging Face plan.

    ``plan`` patterns are relative to ``model`` (whose ``config`` gives MLA's rotary width); ``prefix`` is prepended
    to the returned names (the model's name inside the module the plan is applied to). Raises ``ValueError`` for an
    entry on a module that can neither be translated nor correctly kept replicated. With ``sequence_parallel``, the
    plan's ``sequence_parallel`` entries become torch's ``SequenceParallel`` and the decoder's residual stream is
    sequence-parallel whether the plan says so or not (:func:`hugging_face_sequence_parallel`)."""
    translated: dict[str, ParallelStyle] = {}
    skipped: list[str] = []
    config = getattr(model, "config", None)
    # ``*`` stands for a whole dotted component of digits (a layer index), not for the digits of a name (dense_4h_to_h)
    modules = [(name, re.sub(r"(?<![^.])\d+(?![^.])", "*", name), module) for name, module in model.named_modules() if name]
    for pattern, style_name in plan.items():
        matches = [(name, module) for name, generic, module in modules if generic == pattern]
        if sequence_parallel and style_name == "sequence_parallel":
            translated.update((prefix + name, SequenceParallel(use_local_output=True)) for name, _ in matches)
            continue
        if not matches or style_name in KEPT_REPLICATED_STYLES:
            skipped.append(f"{pattern}: {style_name}")
            continue
        module_type, translate = _TRANSLATIONS.get(style_name, (type(None), None))
        for name, module in matches:
            style = translate(config) if isinstance(module, module_type) else None
            if style is None:
                translated_styles = {known: kind.__name__ for known, (kind, _) in _TRANSLATIONS.items()}
                raise ValueError(
                    f"{type(model).__name__}'s tensor-parallel plan gives {pattern!r} the style {style_name!r}, which"
                    f" lightning_ciuic does not translate for a {type(module).__name__}; kept replicated, it would compute"
                    f" something else than the plan. Translated (style: module): {translated_styles}; kept replicated:"
                    f" {sorted(KEPT_REPLICATED_STYLES)}. Train this model with tensor_parallel_size=1, or give its"
                    f" LightningModule a tensor_parallel_plan(tp_mesh) of torch ParallelStyles."
                )
            translated[prefix + name] = style
    if sequence_parallel:
        hugging_face_sequence_parallel(model, translated, prefix)
    return translated, skipped


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not any(isinstance(m, nn.Linear) for m in module.modules())


def hugging_face_sequence_parallel(model: nn.Module, plan: dict[str, ParallelStyle], prefix: str = "") -> None:
    """Make ``plan`` (translated, names with ``prefix``) sequence-parallel for a Hugging Face decoder ``model``: the
    norms of its decoder layers (the ``nn.ModuleList`` named ``layers``) and the final ones beside them hold ``1/tp``
    of the sequence (``SequenceParallel``); the first layer cuts its whole input (the embedding's output, from which the
    model computes positions and masks) to this rank's part; every other sub-module of a layer that has parameters
    (attention, MLP, mixture of experts) gathers its input and scatters its output back, by its row-parallel output
    projection where it has one (``RowwiseParallel(output_layouts=Shard(1))``), else whole and cut; the LM head
    gathers the sequence and keeps its logits vocabulary-sharded (:func:`vocabulary_sharded_head`). Column-parallel
    linears become ``ColwiseSavingShard`` and a gathered module's unplanned linears ``ReplicatedSavingShard``: where they
    read the gathered input they keep this rank's part of it for backward (:mod:`~lightning_ciuic.parallel.regather`)."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name.split(".")[-1] == "layers"]
    if not found:
        raise ValueError(
            f"sequence_parallel=True, and {type(model).__name__} has no nn.ModuleList named 'layers' (its decoder layers)"
            " to lay out sequence-parallel: pass sequence_parallel=False to the strategy."
        )
    for name, style in plan.items():  # column-parallel linears keep the sequence's part where they read it gathered
        if type(style) is ColwiseParallel and style.input_layouts == (Replicate(),):
            plan[name] = ColwiseSavingShard(output_layouts=style.output_layouts[0], use_local_output=style.use_local_output)
    layers_name, layers = found[0]
    parent_name = layers_name.rpartition(".")[0]
    qualified = lambda *parts: prefix + ".".join(p for p in parts if p)  # noqa: E731
    for index, layer in enumerate(layers):
        layer_name = qualified(layers_name, str(index))
        if index == 0:
            plan[layer_name] = scattered_input()
        for child_name, child in layer.named_children():
            name = f"{layer_name}.{child_name}"
            if _is_norm(child):
                plan[name] = SequenceParallel(use_local_output=True)
                continue
            if not any(True for _ in child.parameters()):
                continue  # dropout and the like: element-wise on this rank's part
            projections = [f"{name}.{n}" for n, _ in child.named_children() if isinstance(plan.get(f"{name}.{n}"), RowwiseParallel)]
            for projection in projections:
                plan[projection] = RowwiseParallel(input_layouts=plan[projection].input_layouts[0], output_layouts=SEQUENCE)
            plan[name] = gathered_input() if projections else gathered_input_scattered_output()
            for linear, module in child.named_children():  # replicated linears reading the gathered input (q_a_proj)
                if isinstance(module, nn.Linear) and f"{name}.{linear}" not in plan:
                    plan[f"{name}.{linear}"] = ReplicatedSavingShard()
    parent = model.get_submodule(parent_name) if parent_name else model
    for child_name, child in parent.named_children():
        if _is_norm(child):
            plan[qualified(parent_name, child_name)] = SequenceParallel(use_local_output=True)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((name for name, m in model.named_modules() if m is head), None) if head is not None else None
    if head_name is None or not isinstance(head, nn.Linear):
        raise ValueError(
            f"sequence_parallel=True, and {type(model).__name__} has no nn.Linear LM head (get_output_embeddings()) to"
            " compute vocabulary-sharded logits with: pass sequence_parallel=False to the strategy."
        )
    plan[prefix + head_name] = vocabulary_sharded_head()
