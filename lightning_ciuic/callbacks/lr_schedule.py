"""Linear warmup then cosine annealing: a pure function, a torch scheduler, and a Lightning callback.

Contract:

* :func:`warmup_cosine_lr` is the whole schedule. For optimizer step ``t`` (0-based), peak ``base_lr``,
  ``W = warmup_steps`` and ``T = max_steps``:

  1. warmup, ``t < W``: ``base_lr * (t + 1) / W`` (the first step already uses a small positive LR);
  2. cosine, ``W <= t < T``: ``min_lr + (base_lr - min_lr) * (1 + cos(pi * (t - W) / (T - W))) / 2``;
  3. after training, ``t >= T``: ``min_lr``.

* :class:`WarmupCosineAnnealingLR` (seed name and signature) applies it per parameter group; ``min_lr``
  is absolute, as in the seed (``initial_lr * 0.01``). Its ``state_dict`` resumes exactly.
* :class:`WarmupCosineSchedule` is the callback form: it installs the scheduler on every optimizer
  from ``trainer.estimated_stepping_batches`` (warmup ``warmup_ratio`` of it, default 8%; ``min_lr``
  ``min_lr_ratio`` of each group's LR, default 1%) without touching ``configure_optimizers``. With
  ``scale_lr_with_batch="linear"`` the peak LR is multiplied by ``effective_batch / reference_batch_size``
  (the linear scaling rule of Goyal et al., 2017), where the effective batch is
  ``batch_size * accumulate_grad_batches * data-parallel replicas``.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override

from lightning_ciuic.strategies.context import parallel_context
from lightning_ciuic.validation import check_int


def warmup_cosine_lr(step: int, base_lr: float, warmup_steps: int, max_steps: int, min_lr: float) -> float:
    """The learning rate at optimizer step ``step`` (0-based); see the module docstring for the three phases."""
    if step < warmup_steps:  # 1. linear warmup
        return base_lr * (step + 1) / warmup_steps
    if step >= max_steps:  # 3. after the schedule
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)  # 2. cosine from base_lr to min_lr
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _validate(warmup_steps: int, max_steps: int, min_lr: float) -> None:
    check_int("max_steps", max_steps)
    check_int("warmup_steps", warmup_steps, minimum=0)
    if warmup_steps >= max_steps:
        raise ValueError(
            f"warmup_steps={warmup_steps} is not shorter than training (max_steps={max_steps}); use warmup_steps"
            f" < max_steps, e.g. {int(max_steps * 0.08)} (8%, the seed's choice)."
        )
    if min_lr < 0:
        raise ValueError(f"min_lr must be >= 0, got {min_lr}.")


class WarmupCosineAnnealingLR(LRScheduler):
    """Seed trick 2: ``WarmupCosineAnnealingLR(optimizer, warmup_steps, max_steps, min_lr)``, stepped once per
    optimizer step. ``min_lr`` is a float for all groups or a list with one value per group."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        max_steps: int,
        min_lr: float | list[float] = 0.0,
        last_epoch: int = -1,
    ) -> None:
        groups = len(optimizer.param_groups)
        self.min_lrs = list(min_lr) if isinstance(min_lr, (list, tuple)) else [float(min_lr)] * groups
        if len(self.min_lrs) != groups:
            raise ValueError(f"min_lr has {len(self.min_lrs)} values but the optimizer has {groups} parameter groups.")
        for value in self.min_lrs:
            _validate(warmup_steps, max_steps, value)
        self.warmup_steps = int(warmup_steps)
        self.max_steps = int(max_steps)
        super().__init__(optimizer, last_epoch)

    @override
    def get_lr(self) -> list[float]:
        step = self.last_epoch
        return [
            warmup_cosine_lr(step, base, self.warmup_steps, self.max_steps, floor)
            for base, floor in zip(self.base_lrs, self.min_lrs)
        ]


class WarmupCosineSchedule(Callback):
    """Install :class:`WarmupCosineAnnealingLR` on every optimizer at the start of ``fit``.

    Args:
        warmup_ratio: fraction of the total optimizer steps spent warming up (seed: 0.08).
        min_lr_ratio: final LR as a fraction of each group's peak LR (seed: 0.01).
        scale_lr_with_batch: ``"none"`` or ``"linear"`` (peak LR scaled by effective batch / reference).
        reference_batch_size: the batch size the configured LR was tuned for (needed with ``"linear"``).
        batch_size: samples per rank per micro-step; read from the datamodule's ``batch_size`` when None.
    """

    def __init__(
        self,
        warmup_ratio: float = 0.08,
        min_lr_ratio: float = 0.01,
        scale_lr_with_batch: Literal["none", "linear"] = "none",
        reference_batch_size: Optional[int] = None,
        batch_size: Optional[int] = None,
    ) -> None:
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}; the seed uses 0.08.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}; the seed uses 0.01.")
        if scale_lr_with_batch not in ("none", "linear"):
            raise ValueError(f"scale_lr_with_batch={scale_lr_with_batch!r}; use 'none' or 'linear'.")
        if scale_lr_with_batch == "linear" and (reference_batch_size is None or reference_batch_size < 1):
            raise ValueError(
                f"scale_lr_with_batch='linear' needs reference_batch_size >= 1 (the batch the LR was tuned for),"
                f" got {reference_batch_size!r}."
            )
        self.warmup_ratio = warmup_ratio
        self.min_lr_ratio = min_lr_ratio
        self.scale_lr_with_batch = scale_lr_with_batch
        self.reference_batch_size = reference_batch_size
        self.batch_size = batch_size
        self.schedulers: list[WarmupCosineAnnealingLR] = []
        self._restored: list[dict[str, Any]] = []

    def effective_batch_size(self, trainer: Trainer) -> int:
        batch = self.batch_size
        if batch is None:
            batch = getattr(trainer.datamodule, "batch_size", None)
        if batch is None:
            raise ValueError("WarmupCosineSchedule(scale_lr_with_batch='linear') needs batch_size=..., or a datamodule with a batch_size attribute.")
        replicas = parallel_context(trainer).dims.dp
        return int(batch) * trainer.accumulate_grad_batches * replicas

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        total = int(trainer.estimated_stepping_batches)
        warmup = int(total * self.warmup_ratio)
        scale = 1.0
        if self.scale_lr_with_batch == "linear":
            assert self.reference_batch_size is not None
            scale = self.effective_batch_size(trainer) / self.reference_batch_size
        self.schedulers = []
        for optimizer in trainer.optimizers:
            if not self._restored:
                for group in optimizer.param_groups:
                    group["lr"] = group.get("initial_lr", group["lr"]) * scale
                    group.pop("initial_lr", None)
            floors = [group.get("initial_lr", group["lr"]) * self.min_lr_ratio for group in optimizer.param_groups]
            scheduler = WarmupCosineAnnealingLR(optimizer, warmup_steps=warmup, max_steps=total, min_lr=floors)
            self.schedulers.append(scheduler)
        for scheduler, state in zip(self.schedulers, self._restored):
            scheduler.load_state_dict(state)
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        rank_zero_info(
            f"WarmupCosineSchedule: {total} optimizer steps, warmup {warmup}, peak LR x{scale:g}, min {self.min_lr_ratio:g} of peak"
        )

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # One scheduler step per optimizer step: only when this batch ended an accumulation window.
        for scheduler in self.schedulers:
            while scheduler.last_epoch < trainer.global_step:
                scheduler.step()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = list(state_dict.get("schedulers", []))
