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

Works with any strategy (the data-parallel group of ``HybridParallelStrategy``, or the world of another).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_ciuic.parallel.experts import RoutedTokens, packed_experts
from lightning_ciuic.strategies.context import parallel_context
from lightning_ciuic.tensors import local_tensor

BIAS_NAME = "e_score_correction_bias"


def router_bias(model: nn.Module, experts_name: str) -> Optional[torch.Tensor]:
    """The ``e_score_correction_bias`` buffer of the module holding ``experts_name`` (searched below it), or None."""
    parent_name = experts_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name)
    found = [buffer for name, buffer in parent.named_buffers() if name.split(".")[-1] == BIAS_NAME]
    return found[0] if len(found) == 1 else None


class ExpertLoadBalancer(Callback):
    """Auxiliary-loss-free expert balancing (see the module docstring).

    Args:
        bias_update_rate: how far each step moves an expert's bias (DeepSeek-V3's gamma; 1e-3 in its report).
    """

    def __init__(self, bias_update_rate: float = 1e-3) -> None:
        if not bias_update_rate > 0:
            raise ValueError(f"bias_update_rate must be > 0, got {bias_update_rate!r} (DeepSeek-V3 used 1e-3).")
        self.bias_update_rate = float(bias_update_rate)
        self.routed: Optional[RoutedTokens] = None
        self.biases: dict[str, torch.Tensor] = {}
        self.group: Optional[dist.ProcessGroup] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        layers = [name for name, _ in packed_experts(pl_module)]
        if not layers and not parallel_context(trainer).dims.pp_enabled:
            raise ValueError(
                f"ExpertLoadBalancer balances mixture-of-experts routers, and {type(pl_module).__name__} has no packed"
                " experts (gate_up_proj/down_proj parameters): remove the callback."
            )
        missing = [name for name in layers if router_bias(pl_module, name) is None]
        if missing:
            raise ValueError(
                f"ExpertLoadBalancer moves each router's {BIAS_NAME} (one value per expert, used to choose experts and"
                f" not to weigh them, as DeepSeek-V3's router does), and the layers {missing} have none"
                f" ({type(pl_module.get_submodule(missing[0].rpartition('.')[0])).__name__}): use a router with such a"
                " bias (transformers' DeepSeek-V3, the example model), or remove the callback."
            )
        self.biases = {name: router_bias(pl_module, name) for name in layers}
        self.group = parallel_context(trainer).dp_group
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

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.routed is not None:
            self.routed.remove()
        self.routed = None
