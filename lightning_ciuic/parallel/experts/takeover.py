"""What expert parallelism computes on each rank's experts, and which modules it may take that over from.

Contract:

* **The form** (:data:`FORM`): expert parallelism replaces a packed-experts module's ``forward`` by its own
  (:func:`~lightning_ciuic.parallel.experts.forward.expert_parallel_forward`), which computes, for each token, the sum
  over its ``k`` experts ``e`` of ``top_k_weights * down_proj[e] @ (act_fn(gate) * up)``, ``gate`` and ``up`` the first
  and the last ``I`` rows of ``gate_up_proj[e] @ hidden``: ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``,
  the module's ``act_fn``, nothing else (no bias, no norm). :func:`~lightning_ciuic.parallel.experts.gemm.run_local_experts`
  is that computation on the rows of each expert a rank holds; :func:`dispatched_output` the whole of it on one rank
  that holds every expert.
* :func:`check_takeover(name, module, verdicts)` raises ``ValueError`` unless the module's own forward is known to
  compute exactly that, naming the module (its path and class), why not, and the form that works; ``None`` when it
  is (``verdicts`` keeps the answers by class, forward, ``act_fn`` and parameter shapes: a model's layers are checked
  once):

  - a transformers experts module (a class transformers' ``use_experts_implementation`` decorates, its forward not
    replaced) with the layout flags of the form (gate/up concatenated, not transposed, no bias, gated, no norm after
    the experts) and transformers' default gating ``act_fn(gate) * up``: DeepSeek-V3, Qwen3-MoE, Mixtral and most of
    transformers' mixture-of-experts families. Known without running it, on any device (the meta device too).
  - any other module with ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``: its own forward is run on
    a check input (:func:`probe`) and must equal :func:`dispatched_output` within its dtype's tolerance (1e-6 of the
    largest output in float64, 1e-2 in float32). The check substitutes random weights (a fixed seed) for every
    floating parameter of the module (``torch.func.functional_call``: the module's own are untouched, its hooks do
    not run) and routes ``2E`` random tokens, token ``t`` to experts ``t`` and ``t + 1`` (mod ``E``), with random
    weights: float64 on the CPU for a module on the CPU or the meta device, float32 on its device otherwise. The
    random weights take one layer's experts of memory; past :data:`PROBE_BYTES` the module's own ``gate_up_proj``
    and ``down_proj`` are used where it holds them (refused if they give no output to compare: all zero, or not
    finite), and a module on the meta device is refused.

No Lightning imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_ciuic import compat
from lightning_ciuic.parallel.experts.gemm import run_local_experts
from lightning_ciuic.parallel.experts.rows import sum_rows
from lightning_ciuic.tensors import local_tensor

FORM = (
    "Expert parallelism takes over packed SwiGLU experts: gate_up_proj [E, 2I, H] (the I gate rows, then the I up"
    " rows), down_proj [E, H, I], an act_fn, no bias, and forward(hidden [T, H], top_k_index [T, k], top_k_weights"
    " [T, k]) = each token's sum over its k experts e of weight * down_proj[e] @ (act_fn(gate) * up), as transformers'"
    " DeepSeek-V3, Qwen3-MoE and Mixtral experts and examples/deepseek.py's PackedExperts compute it"
)
# transformers' layout flags (use_experts_implementation) of the form
HUGGING_FACE_FLAGS = {
    "is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True, "has_post_expert_norm": False,
}
PROBE_BYTES = 1 << 30  # the check's random weights at most; past it, the module's own weights (see the contract)
_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-2}  # of the largest output; else 5e-2 (half precision)


@dataclass(frozen=True)
class _Experts:
    """The three things :func:`run_local_experts` reads, from tensors of one's choosing."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    act_fn: Callable[[torch.Tensor], torch.Tensor]


def dispatched_output(
    experts: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, fp8: bool = False
) -> torch.Tensor:
    """What the expert-parallel forward computes for these tokens, on one rank holding every expert of ``experts``:
    the pairs sorted by expert, :func:`run_local_experts` (by FP8 GEMMs with ``fp8``), each token's outputs summed
    with its routing weights."""
    n_experts = local_tensor(experts.gate_up_proj).shape[0]
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)
    source_token = order // k
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    weights = top_k_weights.reshape(-1).index_select(0, order).to(hidden.dtype)
    computed = run_local_experts(experts, hidden.index_select(0, source_token), counts, 1.0, weights, fp8=fp8)
    return sum_rows(computed, source_token, hidden.shape[0]).to(hidden.dtype)


def check_takeover(name: str, module: nn.Module, verdicts: Optional[dict] = None) -> None:
    """Raise unless expert parallelism may replace ``module``'s forward (see the module docstring). ``verdicts``: the
    answers so far, by module class, forward, ``act_fn`` and parameter shapes (a model's layers are checked once)."""
    key = _verdict_key(module)
    if verdicts is not None and key in verdicts:
        why = verdicts[key]
    else:
        why = _why_not(module)
        if verdicts is not None:
            verdicts[key] = why
    if why is not None:
        raise ValueError(
            f"{name} ({type(module).__name__}) cannot run expert-parallel: {why}. {FORM}. Give {name} that form, or use"
            " expert_parallel_size=1."
        )


def _verdict_key(module: nn.Module) -> tuple:
    """What the answer of :func:`_why_not` depends on, other than the weights' values."""
    act_fn = module.act_fn
    return (
        type(module), getattr(module.forward, "__func__", module.forward),
        type(act_fn) if isinstance(act_fn, nn.Module) else act_fn,
        tuple((n, tuple(p.shape), p.dtype, p.device.type) for n, p in module.named_parameters()),
    )


def _why_not(module: nn.Module) -> Optional[str]:
    """Why ``module``'s own forward is not the expert-parallel one; ``None`` when it is."""
    hugging_face = compat.hugging_face_experts_layout(module)
    if hugging_face is not None:
        wrong = [f"{flag}={hugging_face[flag]}" for flag, value in HUGGING_FACE_FLAGS.items() if hugging_face[flag] != value]
        if wrong:
            return f"transformers marks its experts {', '.join(wrong)}"
        if not hugging_face["default_gate"]:
            return "its class gates its experts its own way (_apply_gate), not act_fn(gate) * up"
        return None
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return (
            f"its gate_up_proj is {list(gate_up.shape)} and its down_proj {list(down.shape)}, not [E, 2I, H] and"
            " [E, H, I] (transposed experts?)"
        )
    return probe(module)


def probe(module: nn.Module, limit: int = PROBE_BYTES) -> Optional[str]:
    """Run ``module``'s own forward and :func:`dispatched_output` on a check input (see the module docstring); ``None``
    when they agree, else why not."""
    gate_up, down = local_tensor(module.gate_up_proj), local_tensor(module.down_proj)
    if not (gate_up.is_floating_point() and down.is_floating_point()):
        return f"its gate_up_proj and down_proj hold {gate_up.dtype} and {down.dtype}, not floating-point weights"
    meta = gate_up.is_meta or down.is_meta
    device = torch.device("cpu") if meta else gate_up.device
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    floating = {n: local_tensor(p) for n, p in module.named_parameters() if p.is_floating_point()}
    size = sum(p.numel() for p in floating.values()) * dtype.itemsize
    own_weights = size > limit
    if own_weights and meta:
        return (
            f"it is on the meta device, and checking its forward needs random weights of its size ({size / 2**30:.1f}"
            f" GiB, over the check's {limit / 2**30:.1f} GiB): build it with its weights, or give it transformers' form"
        )
    if own_weights:
        dtype = gate_up.dtype
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for param_name, param in floating.items():
        if own_weights and param_name in ("gate_up_proj", "down_proj"):
            weights[param_name] = param
            continue
        scale = param.shape[-1] ** -0.5 if param.dim() > 1 else 0.5
        weights[param_name] = (torch.randn(param.shape, generator=generator, dtype=dtype) * scale).to(device)
    n_experts, hidden_size = gate_up.shape[0], gate_up.shape[2]
    tokens, k = max(2 * n_experts, 4), min(2, n_experts)
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64).to(device, dtype)
    index = torch.stack([torch.arange(tokens) % n_experts, (torch.arange(tokens) + 1) % n_experts], dim=1)[:, :k].to(device)
    routing = (torch.rand(tokens, k, generator=generator, dtype=torch.float64) + 0.5).to(device, dtype)
    experts = _Experts(weights["gate_up_proj"], weights["down_proj"], module.act_fn)
    with torch.no_grad():
        expected = dispatched_output(experts, hidden, index, routing)
        scale = expected.abs().max().item()
        if not (scale > 0 and expected.isfinite().all()):
            return "its own weights, with which it is checked, give no output to compare (all zero, or not finite)"
        try:
            own = torch.func.functional_call(_Forward(module), {f"module.{n}": w for n, w in weights.items()}, (hidden, index, routing))
        except Exception as err:  # noqa: BLE001 - any failure of its forward on the form's arguments is the answer
            said = (str(err).strip().splitlines() or [""])[0]
            return f"its forward(hidden, top_k_index, top_k_weights) raised {type(err).__name__}: {said}"
        return _difference(module, experts, own, expected, scale, (hidden, index, routing))


class _Forward(nn.Module):
    """Calls ``module.forward`` alone: its own hooks (token counters, ...) do not see the check."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: torch.Tensor) -> Any:
        return self.module.forward(*args)


def _difference(module: nn.Module, experts: _Experts, own: Any, expected: torch.Tensor, scale: float, inputs: tuple) -> Optional[str]:
    """``None`` when ``own`` is ``expected`` within the dtype's tolerance, else what differs."""
    if not isinstance(own, torch.Tensor) or own.shape != expected.shape:
        shape = list(own.shape) if isinstance(own, torch.Tensor) else type(own).__name__
        return f"its forward(hidden, top_k_index, top_k_weights) returns {shape}, not [T, H] = {list(expected.shape)}"
    tolerance = _TOLERANCE.get(expected.dtype, 5e-2) * scale
    error = (own.to(expected.dtype) - expected).abs().max().item()
    if error <= tolerance:
        return None
    half = experts.gate_up_proj.shape[1] // 2
    swapped = _Experts(torch.cat([experts.gate_up_proj[:, half:], experts.gate_up_proj[:, :half]], dim=1), experts.down_proj, experts.act_fn)
    if (own.to(expected.dtype) - dispatched_output(swapped, *inputs)).abs().max().item() <= tolerance:
        return "it computes act_fn(up) * gate: its gate_up_proj holds the up rows first"
    extra = [n for n, p in module.named_parameters() if n not in ("gate_up_proj", "down_proj")]
    held = f"; it has parameters besides gate_up_proj and down_proj, which the expert-parallel forward would not use: {extra}" if extra else ""
    return (
        f"on a check input ({expected.shape[0]} tokens, 2 experts each, random weights), its forward differs from the"
        f" expert-parallel one by up to {error:.3g} (outputs up to {scale:.3g}){held}"
    )
