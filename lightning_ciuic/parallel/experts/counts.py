"""Tokens routed to each expert, counted as they enter the experts: what the load-balance callback and the monitor read.

Contract: :class:`RoutedTokens(module)` hooks every packed-experts module of ``module``
(:func:`~lightning_ciuic.parallel.experts.layout.packed_experts`) and counts, per module, the tokens this rank routed
to each expert, in training mode (with or without expert parallelism; not again when activation checkpointing
recomputes a block in backward). ``take()`` returns ``{module name: counts [E]}`` since the last call and starts
again; ``remove()`` detaches the hooks.

No Lightning imports.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from lightning_ciuic import compat
from lightning_ciuic.parallel.experts.layout import packed_experts


class RoutedTokens:
    """Tokens this rank routed to each expert of each packed-experts module of ``module`` (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = dict(packed_experts(module))
        self.counts: dict[str, torch.Tensor] = {}
        self._handles = [
            experts.register_forward_pre_hook(functools.partial(self._count, name), with_kwargs=True)
            for name, experts in self.modules.items()
        ]

    def _count(self, name: str, experts: nn.Module, args: tuple, kwargs: dict) -> None:
        if not experts.training or compat.in_backward():
            return  # evaluation; or a recompute, which routes the same tokens again
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        counts = torch.bincount(index.reshape(-1), minlength=experts.gate_up_proj.shape[0])
        previous = self.counts.get(name)
        self.counts[name] = counts if previous is None else previous + counts

    def take(self) -> dict[str, torch.Tensor]:
        counts, self.counts = self.counts, {}
        return counts

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
