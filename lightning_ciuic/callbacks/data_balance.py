"""DynamicDataBalancer: give faster data-parallel ranks a larger share of the same global batch.

Contract:

* Data: the training DataLoader that Lightning prepares (its ``DistributedSampler`` over the data-parallel
  ranks: the ``dp`` axis of ``HybridParallelStrategy``, every rank of ``DDPStrategy``) is replaced by one
  over :class:`~lightning_ciuic.data.balance.BalancedBatchSampler`: the same seed, epoch order and global
  batches (``batch_size x dp``), so with an even split training sees exactly what it would without the
  balancer. Needs a map-style dataset and a DataLoader built with ``batch_size`` (not its own batch sampler); an
  iterable or streaming loader (LitData's, a rank-splitting ``IterableDataset``) is refused at the start of ``fit``,
  once, saying why: it yields samples in its own order, so no share of a batch can move between ranks.
* Measurement (from :mod:`lightning_ciuic.telemetry`): each rank's compute time (forward + backward up to the
  last gradient, never the wait for other ranks) and samples. Every ``monitoring_freq`` optimizer steps the
  window is gathered; a dp rank's step time is the slowest of its tensor-parallel peers.
* Rule: when ``(slowest - fastest) / mean`` of the dp ranks' step times exceeds ``imbalance_threshold``,
  shares are set proportional to speed (samples per second of compute), at least
  ``max(1, ceil(min_share * batch_size))`` samples per rank (``min_share`` is a fraction of the even share).

  - ``"throughput"``: speed = samples / compute time summed over the window; the split moves to the target.
  - ``"gradient_aware"`` (the seed's default): speed is the *median* of per-step speeds (one slow step
    cannot swing it); no share changes by more than half of its value in one rebalance; and no rebalance is
    made from a window whose global gradient norm was unstable (non-finite, or a step above 10x the window's
    median), since timings taken around a loss spike or a recovery are not representative.

* Exactness: the global batch, steps per epoch and LR schedule are unchanged; every sample of an epoch is
  seen once; each rank's loss gradient is scaled by ``dp * n_rank / n_global`` (a hook on the loss tensor),
  so the data-parallel mean gradient equals the gradient of the whole global batch, however it is split.
  Losses must be means over the batch (the usual case); a sum-reduced loss would be over-weighted.
* State: the split and the position in the epoch are saved in checkpoints; a resume continues the epoch
  exactly where it stopped (a different dp size starts from an even split). Logged at each check:
  ``balance/imbalance`` and ``balance/share_<dp rank>``.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler
from typing_extensions import override

from lightning_ciuic.callbacks.train_loader import add_train_loader_transform, remove_train_loader_transform
from lightning_ciuic.data.balance import BalancedBatchSampler, imbalance, rebalanced_split
from lightning_ciuic.data.resume import PositionedDataLoader, with_batch_sampler
from lightning_ciuic.parallel.shutdown import raise_once
from lightning_ciuic.telemetry import StepRecord, Telemetry, gather_per_rank, samples_in
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.strategies.context import parallel_context
from lightning_ciuic.validation import check_int

RebalanceStrategy = Literal["throughput", "gradient_aware"]
_MAX_SHIFT = 0.5  # gradient_aware: largest relative change of one share per rebalance
_SPIKE = 10.0  # gradient_aware: a gradient norm this many times the window median marks it unstable


class DynamicDataBalancer(Callback):
    """Straggler-aware shares of each global batch; see the module docstring.

    Args:
        monitoring_freq: optimizer steps between checks of the measured imbalance.
        imbalance_threshold: rebalance when ``(slowest - fastest) / mean`` step time exceeds this (> 0).
        rebalance_strategy: ``"throughput"`` or ``"gradient_aware"`` (defined in the module docstring).
        min_share: smallest share of a rank, as a fraction of the even share ``batch_size`` (0 < x <= 1).
    """

    def __init__(
        self,
        monitoring_freq: int = 1000,
        imbalance_threshold: float = 0.15,
        rebalance_strategy: RebalanceStrategy = "gradient_aware",
        min_share: float = 0.25,
    ) -> None:
        check_int("monitoring_freq", monitoring_freq, note="optimizer steps")
        if not imbalance_threshold > 0:
            raise ValueError(
                f"imbalance_threshold must be > 0 (a fraction of the mean step time, e.g. 0.15), got {imbalance_threshold!r}."
            )
        if rebalance_strategy not in ("throughput", "gradient_aware"):
            raise ValueError(
                f"rebalance_strategy={rebalance_strategy!r} is unknown; use 'throughput' or 'gradient_aware'."
            )
        if not 0 < min_share <= 1:
            raise ValueError(
                f"min_share must be in (0, 1] (a fraction of the even share; no rank may get zero samples),"
                f" got {min_share!r}."
            )
        self.monitoring_freq = monitoring_freq
        self.imbalance_threshold = float(imbalance_threshold)
        self.rebalance_strategy = rebalance_strategy
        self.min_share = float(min_share)
        self.sampler: Optional[BalancedBatchSampler] = None
        self.rebalances = 0
        self._weight = 1.0
        self._cursor = 0
        self._last_check = 0
        self._grad_norms: list[float] = []
        self._position = (0, 0)  # (epoch, global batches done in it)
        self._restored: Optional[dict[str, Any]] = None

    # -- data ----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            add_train_loader_transform(trainer, self._balanced)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        remove_train_loader_transform(trainer, self._balanced)
        Telemetry.release(trainer)

    def _balanced(self, trainer: Trainer, loader: object) -> DataLoader:
        if not isinstance(loader, DataLoader):
            raise TypeError(f"DynamicDataBalancer needs a torch DataLoader for training, got {type(loader).__name__}.")
        if isinstance(loader.batch_sampler, BalancedBatchSampler):
            return loader
        if isinstance(loader, PositionedDataLoader):  # SnapshotRecovery's position wrapper: balance the original
            loader = loader.source
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            litdata = any(cls.__module__.startswith("litdata") for cls in type(dataset).__mro__)
            streaming = " (LitData's StreamingDataset streams each rank's chunks in order)" if litdata else ""
            raise_once(TypeError(
                f"DynamicDataBalancer moves samples between the data-parallel ranks' shares of each global batch, by"
                f" index, which needs a map-style dataset (__len__ and __getitem__); the training {type(loader).__name__}"
                f" reads {type(dataset).__name__}, an iterable dataset that yields its samples in its own order{streaming},"
                " so no share can move. Train it without DynamicDataBalancer (every replica then takes batch_size"
                " samples a step), or from a map-style dataset."
            ))
        if loader.batch_size is None:
            raise ValueError(
                "DynamicDataBalancer needs a DataLoader built with batch_size=...; a custom batch_sampler cannot"
                " be re-split between ranks."
            )
        sampler = loader.sampler
        if isinstance(sampler, DistributedSampler):
            dp, rank, shuffle, seed = sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed
        else:
            context = parallel_context(trainer)
            dp, rank = context.dims.dp, context.dp_rank
            shuffle, seed = isinstance(sampler, RandomSampler), int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.sampler = BalancedBatchSampler(
            len(dataset), loader.batch_size * dp, rank, dp, shuffle=shuffle, seed=seed, drop_last=loader.drop_last
        )
        self._restore_into(self.sampler)
        return with_batch_sampler(loader, self.sampler)

    @property
    def min_samples(self) -> int:
        assert self.sampler is not None
        return max(1, math.ceil(self.min_share * self.sampler.global_batch_size / self.sampler.num_replicas))

    # -- per batch ------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        telemetry = Telemetry.of(trainer)
        telemetry.begin(trainer.global_step, batch_idx, batch)
        self._weight = 1.0
        sampler = self.sampler
        if sampler is not None and sampler.num_replicas > 1:
            window = min(sampler.global_batch_size, sampler.num_samples - batch_idx * sampler.global_batch_size)
            self._weight = sampler.num_replicas * samples_in(batch) / window

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        weight = self._weight
        if weight != 1.0 and loss.requires_grad:
            loss.register_hook(lambda grad: grad * weight)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.rebalance_strategy == "gradient_aware":  # this rank's (local shard) norm; ranks vote at the check
            grads = [local_tensor(p.grad) for p in pl_module.parameters() if p.grad is not None]
            self._grad_norms.append(float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        Telemetry.of(trainer).end()
        self._position = (trainer.current_epoch, batch_idx + 1)
        step = trainer.global_step
        if self.sampler is not None and step != self._last_check and step % self.monitoring_freq == 0:
            self._last_check = step
            self._check(trainer, pl_module)

    def _check(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Gather the window from every rank and decide, from the same numbers everywhere, the next split."""
        assert self.sampler is not None
        records, self._cursor = Telemetry.of(trainer).records_since(self._cursor)
        norms, self._grad_norms = self._grad_norms, []
        rows = gather_per_rank(trainer, [self.sampler.rank, *_window_stats(records), float(_unstable(norms))])
        split = self.sampler.split
        step_times, speeds = _per_dp_rank(rows[:, :-1], self.sampler.num_replicas, self.rebalance_strategy)
        measured = imbalance(step_times)
        new = None
        if bool(rows[:, -1].max() > 0):
            rank_zero_info("DynamicDataBalancer: gradient norm unstable in this window on some rank; split kept.")
        else:
            max_shift = _MAX_SHIFT if self.rebalance_strategy == "gradient_aware" else None
            new = rebalanced_split(split, speeds, step_times, self.imbalance_threshold, self.min_samples, max_shift)
        if new is not None:
            self.sampler.split = new
            self.rebalances += 1
            rank_zero_info(
                f"DynamicDataBalancer: step {trainer.global_step}, imbalance {measured:.2f} >"
                f" {self.imbalance_threshold}: split {split} -> {new} (step times"
                f" {[round(t * 1e3, 1) for t in step_times]} ms)"
            )
        pl_module.log("balance/imbalance", measured, on_step=True, on_epoch=False, rank_zero_only=True)
        for rank, share in enumerate(self.sampler.split):
            pl_module.log(f"balance/share_{rank}", float(share), on_step=True, on_epoch=False, rank_zero_only=True)

    # -- checkpoints ----------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.sampler is None:
            return dict(self._restored or {})
        epoch, done = self._position
        return {
            "split": self.sampler.split,
            "global_batch_size": self.sampler.global_batch_size,
            "epoch": epoch,
            "batches_done": done,
            "rebalances": self.rebalances,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
        self.rebalances = int(state_dict.get("rebalances", 0))

    def _restore_into(self, sampler: BalancedBatchSampler) -> None:
        state, self._restored = self._restored, None
        if not state:
            return
        sampler.resume(state["epoch"], state["batches_done"])
        if len(state["split"]) == sampler.num_replicas and state["global_batch_size"] == sampler.global_batch_size:
            sampler.split = state["split"]
        else:
            rank_zero_info(
                f"DynamicDataBalancer: checkpoint split {state['split']} does not fit {sampler.num_replicas} ranks x"
                f" global batch {sampler.global_batch_size}; starting from an even split."
            )


def _window_stats(records: list[StepRecord]) -> list[float]:
    """``[compute seconds, samples, steps, median samples/second]`` of this rank's window."""
    compute = sum(r.compute for r in records)
    samples = sum(r.samples for r in records)
    speeds = [r.samples / r.compute for r in records if r.compute > 0]
    return [compute, float(samples), float(len(records)), statistics.median(speeds) if speeds else 0.0]


def _per_dp_rank(rows: torch.Tensor, dp: int, strategy: RebalanceStrategy) -> tuple[list[float], list[float]]:
    """Per dp rank: mean compute time per step and speed, taking the slowest tensor-parallel peer."""
    step_times, speeds = [0.0] * dp, [math.inf] * dp
    for dp_rank, compute, samples, steps, median_speed in rows.tolist():
        r = int(dp_rank)
        step_times[r] = max(step_times[r], compute / max(steps, 1.0))
        speed = median_speed if strategy == "gradient_aware" else samples / compute if compute > 0 else 0.0
        speeds[r] = min(speeds[r], speed)
    return step_times, speeds


def _unstable(norms: list[float]) -> bool:
    if not norms:
        return False
    if not all(math.isfinite(n) for n in norms):
        return True
    median = statistics.median(norms)
    return median > 0 and max(norms) > _SPIKE * median
