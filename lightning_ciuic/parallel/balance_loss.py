"""DeepSeek-V3's sequence-wise balance loss, added to the gradients of mixture-of-experts routers.

Contract:

* For each packed-experts layer (:func:`~lightning_ciuic.parallel.experts.packed_experts`) of a module, in each
  training forward: the router's logits (the first output of the ``gate`` module next to the experts; a tensor or a
  tuple whose first item it is), the experts chosen for each token (the experts' ``top_k_index``) and the batch shape
  ``[B, S]`` the layer received give, per sequence of ``T = S`` tokens (DeepSeek-V3 report, section 2.1.2, eq. 17-20)::

      s'[i, t] = s[i, t] / sum_j s[j, t]                      s: the router's scores (softmax or sigmoid of the logits)
      f[i] = N / (K T) * sum_t 1(expert i among token t's K)  (no gradient)
      P[i] = 1 / T * sum_t s'[i, t]
      L = weight * sum_i f[i] P[i]

  averaged over the ``B`` sequences. Its gradient reaches the router in backward without changing the loss the
  training step returns or logs: the experts' input carries it (an identity whose backward also starts ``L``'s), so
  the parameters get ``d(loss + scale * L)``, ``scale`` set by the caller (one over the forwards of one optimizer
  step: gradient accumulation and pipeline micro-batches, which divide the training loss the same way).
* The score function comes from the module holding the experts (an attribute ``router_score_function``: "softmax"
  or "sigmoid") or from the router's class (transformers' DeepSeek-V3: sigmoid; Mixtral, Qwen3-MoE: softmax); a layer
  with neither is refused, naming it.
* Activation-checkpointing recomputes run the same computation (checkpointing wants the same saved tensors) and add
  nothing: the original forward's backward already carries the loss. ``take()`` returns the sum over layers of the
  weighted losses since the last call (detached, for logging); ``remove()`` detaches the hooks.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from lightning_ciuic import compat
from lightning_ciuic.parallel.experts import packed_experts

ROUTER_SCORES = {"DeepseekV3TopkRouter": "sigmoid", "MixtralTopKRouter": "softmax", "Qwen3MoeTopKRouter": "softmax"}
SCORE_FUNCTIONS = ("softmax", "sigmoid")


def router_score_function(moe: nn.Module) -> Optional[str]:
    """How the router of ``moe`` (the module holding the experts) turns logits into scores, or None if unknown."""
    declared = getattr(moe, "router_score_function", None)
    if declared is not None:
        if declared not in SCORE_FUNCTIONS:
            raise ValueError(
                f"{type(moe).__name__}.router_score_function is {declared!r}; it must be one of {SCORE_FUNCTIONS}."
            )
        return declared
    gate = getattr(moe, "gate", None)
    return ROUTER_SCORES.get(type(gate).__name__) if gate is not None else None


def sequence_balance_loss(
    logits: torch.Tensor, chosen: torch.Tensor, sequences: int, score_function: str
) -> torch.Tensor:
    """The unweighted sequence-wise balance loss (see the module docstring), averaged over ``sequences``.

    ``logits``: ``[B * T, N]`` router logits; ``chosen``: ``[B * T, K]`` expert indices."""
    n_experts, top_k = logits.shape[-1], chosen.shape[-1]
    logits = logits.reshape(sequences, -1, n_experts)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    tokens = logits.shape[1]
    scores = logits.softmax(dim=-1) if score_function == "softmax" else logits.sigmoid()
    probability = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)  # P: [B, N]
    hits = torch.zeros(sequences, n_experts, dtype=logits.dtype, device=logits.device)
    hits.scatter_add_(1, chosen.reshape(sequences, -1), torch.ones_like(chosen.reshape(sequences, -1), dtype=logits.dtype))
    fraction = hits * (n_experts / (top_k * tokens))  # f: [B, N]
    return (fraction * probability).sum(dim=-1).mean()


class _AddLossGradient(torch.autograd.Function):
    """Identity on ``x``; its backward also sends a gradient of 1 into ``loss`` (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


class SequenceBalanceLoss:
    """Hooks that add ``weight * scale *`` the sequence-wise balance loss to the backward of each packed-experts layer
    of ``module`` (see the module docstring)."""

    def __init__(self, module: nn.Module, weight: float, scale: float = 1.0) -> None:
        self.weight, self.scale = float(weight), float(scale)
        layers = [(name, experts, module.get_submodule(_parent(name))) for name, experts in packed_experts(module)]
        scores = {name: router_score_function(moe) for name, _, moe in layers}
        unknown = [name for name, score in scores.items() if score is None]
        if unknown:
            moe = module.get_submodule(_parent(unknown[0]))
            raise ValueError(
                f"the sequence-wise balance loss needs each router's scores, and the score function of the layers"
                f" {unknown} is unknown ({type(moe).__name__}, router {type(getattr(moe, 'gate', None)).__name__}):"
                f" set {type(moe).__name__}.router_score_function to 'softmax' or 'sigmoid', or set"
                " sequence_balance_weight=0."
            )
        self._total: Optional[torch.Tensor] = None
        self._handles = []
        for name, experts, moe in layers:
            seen = {"score_function": scores[name]}  # what this layer's forward has shown so far
            self._handles += [
                moe.register_forward_pre_hook(functools.partial(self._see_batch, seen), with_kwargs=True),
                moe.gate.register_forward_hook(functools.partial(self._see_logits, seen)),
                experts.register_forward_pre_hook(functools.partial(self._add_loss, seen), with_kwargs=True),
            ]

    @staticmethod
    def _see_batch(seen: dict, moe: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else next(iter(kwargs.values()))
        seen["sequences"] = hidden.shape[0] if hidden.dim() == 3 else 1  # [B, S, H], or the tokens of one sequence

    @staticmethod
    def _see_logits(seen: dict, gate: nn.Module, args: tuple, output: Any) -> None:
        seen["logits"] = output[0] if isinstance(output, (tuple, list)) else output

    def _add_loss(self, seen: dict, experts: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        if not experts.training or not torch.is_grad_enabled():
            return None
        logits = seen.pop("logits")
        chosen = args[1] if len(args) > 1 else kwargs["top_k_index"]
        loss = self.weight * sequence_balance_loss(logits, chosen, seen["sequences"], seen["score_function"])
        if not compat.in_backward():
            detached = loss.detach()
            self._total = detached if self._total is None else self._total + detached
        scaled = loss * self.scale
        if args:
            return (_AddLossGradient.apply(args[0], scaled), *args[1:]), kwargs
        first = next(iter(kwargs))
        return args, {**kwargs, first: _AddLossGradient.apply(kwargs[first], scaled)}

    def take(self) -> Optional[torch.Tensor]:
        total, self._total = self._total, None
        return total

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _parent(name: str) -> str:
    return name.rpartition(".")[0]
