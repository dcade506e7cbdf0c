"""ExpertLoadBalancer: DeepSeek-V3's auxiliary-loss-free load balancing of mixture-of-experts routers.

Contract:

* Each packed-experts layer (:func:`~lightning_ciuic.parallel.experts.packed_experts`) has a router bias: a buffer
  named ``e_score_correction_bias`` (one value per expert) in the module that holds the experts, which takes part in
  choosing each token's experts and not in weighing them (transformers' DeepSeek-V3 keeps it in ``mlp.gate``, the
  example model in its ``MixtureOfExperts``). A layer without one is refused when fit starts, naming it: Mixtral's and
  Qwen3-MoE's routers choose by their softmax alone.
* After each optimizer step's backward, per layer: the tokens routed to each expert during the step (every
  micro-batch, :class:`~lightning_ciuic.parallel.experts.RoutedTokens`) summed over the data-parallel ranks (tensor-
  parallel peers route the same tokens and are not added; a pipeline stage holds its own layers), then
  ``bias += bias_update_rate * sign(mean - load)`` (DeepSeek-V3 report, section 2.1.2; their rate is 1e-3). Every rank
  applies the same update to the same sums: replicas stay equal. The bias is a buffer: checkpoints keep it.
* Logged at each update: ``moe/max_over_mean``, the largest over this rank's layers of max / mean tokens per expert
  (1.0: every expert got the same number).
* ``bias_update_rate=0`` leaves the biases alone (and routers without one are accepted).
* ``sequence_balance_weight > 0`` adds DeepSeek-V3's sequence-wise balance loss times it (their alpha: 1e-4) to the
  gradients (:mod:`~lightning_ciuic.parallel.balance_loss`), weighted like the training loss: one over the forwards
  of an optimizer step (``accumulate_grad_batches`` x pipeline micro-batches). The loss the training step returns is
  unchanged; the balance loss is logged as ``moe/sequence_balance_loss`` (this rank's, summed over its layers, per
  step). A GradScaler (``precision="16-mixed"``) would not scale the added gradient: it is refused.
* A refusal at fit start is raised once, by the lowest refusing rank, the others stopping quietly, under
  ``HybridParallelStrategy`` (:func:`~lightning_ciuic.parallel.shutdown.reported_once`); under another strategy by
  every rank, as it came.

Works with any strategy (the data-parallel group of ``HybridParallelStrategy``, or the world of another).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_ciuic.parallel.balance_loss import SequenceBalanceLoss
from lightning_ciuic.parallel.experts import RoutedTokens, experts_parent, packed_experts
from lightning_ciuic.parallel.shutdown import reported_once
from lightning_ciuic.strategies.context import parallel_context
from lightning_ciuic.tensors import local_tensor

BIAS_NAME = "e_score_correction_bias"


def router_bias(model: nn.Module, experts_name: str) -> Optional[torch.Tensor]:
    """The ``e_score_correction_bias`` buffer of the module holding ``experts_name`` (searched below it), or None."""
    found = [buffer for name, buffer in experts_parent(model, experts_name).named_buffers() if name.split(".")[-1] == BIAS_NAME]
    return found[0] if len(found) == 1 else None


class ExpertLoadBalancer(Callback):
    """Auxiliary-loss-free expert balancing (see the module docstring).

    Args:
        bias_update_rate: how far each step moves an expert's bias (DeepSeek-V3's gamma; 1e-3 in its report); 0 moves
            none.
        sequence_balance_weight: the weight of the sequence-wise balance loss (DeepSeek-V3's alpha; 1e-4 in its
            report); 0, the default, adds none.
    """

    def __init__(self, bias_update_rate: float = 1e-3, sequence_balance_weight: float = 0.0) -> None:
        if not bias_update_rate >= 0:
            raise ValueError(
                f"bias_update_rate must be >= 0, got {bias_update_rate!r} (DeepSeek-V3 used 1e-3; 0 moves no bias)."
            )
        if not sequence_balance_weight >= 0:
            raise ValueError(
                f"sequence_balance_weight must be >= 0, got {sequence_balance_weight!r} (DeepSeek-V3 used 1e-4; 0 adds"
                " no balance loss)."
            )
        if bias_update_rate == 0 and sequence_balance_weight == 0:
            raise ValueError(
                "ExpertLoadBalancer(bias_update_rate=0, sequence_balance_weight=0) balances nothing: set either above 0"
                " (DeepSeek-V3: 1e-3 and 1e-4), or remove the callback."
            )
        self.bias_update_rate = float(bias_update_rate)
        self.sequence_balance_weight = float(sequence_balance_weight)
        self.balance_loss: Optional[SequenceBalanceLoss] = None
        self.routed: Optional[RoutedTokens] = None
        self.biases: dict[str, torch.Tensor] = {}
        self.group: Optional[dist.ProcessGroup] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with reported_once("ExpertLoadBalancer.on_fit_start"):  # a refusal is said once, by the lowest refusing rank
            self._start(trainer, pl_module)

    def _start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        context = parallel_context(trainer)
        layers = [name for name, _ in packed_experts(pl_module)]
        if not layers and not context.dims.pp_enabled:
            raise ValueError(
                f"ExpertLoadBalancer balances mixture-of-experts routers, and {type(pl_module).__name__} has no packed"
                " experts (gate_up_proj/down_proj parameters): remove the callback."
            )
        missing = [name for name in layers if router_bias(pl_module, name) is None] if self.bias_update_rate else []
        if missing:
            raise ValueError(
                f"ExpertLoadBalancer moves each router's {BIAS_NAME} (one value per expert, used to choose experts and"
                f" not to weigh them, as DeepSeek-V3's router does), and the layers {missing} have none"
                f" ({type(pl_module.get_submodule(missing[0].rpartition('.')[0])).__name__}): use a router with such a"
                " bias (transformers' DeepSeek-V3, the example model), bias_update_rate=0 with a"
                " sequence_balance_weight, or remove the callback."
            )
        if self.bias_update_rate:
            self.biases = {name: router_bias(pl_module, name) for name in layers}
        if self.sequence_balance_weight:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                raise ValueError(
                    f"ExpertLoadBalancer(sequence_balance_weight={self.sequence_balance_weight}) adds the balance loss's"
                    f" gradient in backward, which {type(scaler).__name__}'s loss scale would not reach (precision="
                    f"{trainer.precision!r}): use precision='bf16-mixed' or '32-true', or sequence_balance_weight=0."
                )
            pipeline = context.pipeline
            forwards = trainer.accumulate_grad_batches * (pipeline.num_microbatches if pipeline is not None else 1)
            self.balance_loss = SequenceBalanceLoss(pl_module, self.sequence_balance_weight, scale=1.0 / forwards)
        self.group = context.dp_group
        self.routed = RoutedTokens(pl_module)

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        assert self.routed is not None
        counts = self.routed.take()
        worst = 0.0
        for name, bias in self.biases.items():
            load = counts.get(name)
            if load is None:
                continue
            load = load.to(torch.float64)
            if self.group is not None:
                dist.all_reduce(load, group=self.group)
            mean = load.mean()
            local_tensor(bias).add_(torch.sign(mean - load).to(bias.dtype), alpha=self.bias_update_rate)
            worst = max(worst, float(load.max() / mean) if mean > 0 else 0.0)
        if self.biases:
            pl_module.log("moe/max_over_mean", worst, on_step=True, on_epoch=False)
        balance_loss = self.balance_loss.take() if self.balance_loss is not None else None
        if balance_loss is not None:
            # the mean over the step's forwards, as the training loss is
            pl_module.log("moe/sequence_balance_loss", balance_loss * self.balance_loss.scale, on_step=True, on_epoch=False)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.routed is not None:
            self.routed.remove()
        if self.balance_loss is not None:
            self.balance_loss.remove()
        self.routed = self.balance_loss = None
