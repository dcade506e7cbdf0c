"""ElasticResourceManager (seed trick 7): elastic nodes on TorchElastic, with performance-aware scale decisions.

Contract:

* Launch: ``torchrun --nnodes=MIN:MAX --rdzv-backend=c10d ...`` (TorchElastic; never a launcher of ours). When a
  node is lost or preempted, or a node joins, TorchElastic restarts every worker with the new membership. The
  restarted workers resume through :class:`~lightning_ciuic.callbacks.recovery.SnapshotRecovery` (required in
  the same Trainer): the newest snapshot, resharded over the new data-parallel size (``pp`` and ``tp`` stay), or
  else the last ``AsyncCheckpointer`` checkpoint (DCP reshards it).
* Global batch: the first run's global batch (per-rank batch x dp x ``accumulate_grad_batches``, or
  ``global_batch_size``) is kept in this callback's state; after a membership change ``accumulate_grad_batches``
  becomes ``global / (per-rank batch x dp)``. When that does not divide, the nearest accumulation is used and the
  learning rate follows the linear scaling rule (Goyal et al. 2017): it is multiplied by new / old global batch.
* Data: the position in the epoch is kept in samples (``PositionedDataLoader``), so the restarted run continues at
  the first sample of the epoch's order not yet seen: nothing skipped or repeated.
* Monitoring: every ``monitoring_interval`` seconds (rank 0's clock, agreed at a step boundary) each node's
  samples and compute time and the cluster's step and exposed communication times (from
  :mod:`lightning_ciuic.telemetry`) go through :func:`~lightning_ciuic.parallel.scaling.decide`. The decision is
  logged (``elastic/*`` metrics and a log line), passed to ``on_decision(decision)`` on global rank 0, and
  appended as one JSON line to ``decisions_file`` for a cluster manager to act on (we decide; the cluster
  manager adds or removes machines).
* Preemption: SIGTERM on any rank (a spot reclaim) is seen by every rank at the next step boundary; a snapshot is
  taken there and every worker exits with :class:`NodePreempted`, so TorchElastic re-forms the group without the
  leaving node and the others resume from that snapshot, losing no step. During training this callback owns
  SIGTERM (Lightning's own handler issues a collective from inside the signal handler, on one rank only).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ciuic.comm.vote import StepVote
from lightning_ciuic.strategies.context import batch_end_vote, step_vote
from lightning_ciuic.callbacks.recovery import SnapshotRecovery
from lightning_ciuic.parallel.scaling import NodeWindow, ScaleDecision, decide
from lightning_ciuic.telemetry import Telemetry, gather_per_rank
from lightning_ciuic.strategies.context import parallel_context
from lightning_ciuic.validation import check_choice, check_int

ScalingStrategy = Literal["performance_aware"]
_STRATEGIES = ("performance_aware",)
_VOTE = "ElasticResourceManager"  # its slot in the per-step vote


class NodePreempted(RuntimeError):
    """Raised on every worker after a SIGTERM was seen and a snapshot taken: TorchElastic re-forms the group."""


class ElasticResourceManager(Callback):
    """Elastic nodes and scale decisions; see the module docstring.

    Args:
        monitoring_interval: seconds between scale decisions.
        scaling_threshold: a relative throughput change that justifies adding or keeping a node (> 0).
        scaling_strategy: ``"performance_aware"``.
        max_nodes, min_nodes: bounds of every decision (1 <= min_nodes <= max_nodes).
        global_batch_size: samples per optimizer step to keep across membership changes (default: the first run's).
        on_decision: called with each :class:`~lightning_ciuic.parallel.scaling.ScaleDecision` on global rank 0.
        decisions_file: JSON lines of decisions (a relative path goes beside the run's logs, ``trainer.log_dir``, or
            under ``trainer.default_root_dir`` without a logger).
    """

    def __init__(
        self,
        monitoring_interval: float = 300.0,
        scaling_threshold: float = 0.15,
        scaling_strategy: ScalingStrategy = "performance_aware",
        max_nodes: int = 8,
        min_nodes: int = 2,
        global_batch_size: Optional[int] = None,
        on_decision: Optional[Callable[[ScaleDecision], Any]] = None,
        decisions_file: str = "elastic_decisions.jsonl",
    ) -> None:
        for name, value in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
            check_int(name, value)
        if min_nodes > max_nodes:
            raise ValueError(f"min_nodes={min_nodes} > max_nodes={max_nodes}; use min_nodes <= max_nodes.")
        if not scaling_threshold > 0:
            raise ValueError(f"scaling_threshold must be > 0 (a relative throughput change, e.g. 0.15), got {scaling_threshold!r}.")
        if not monitoring_interval > 0:
            raise ValueError(f"monitoring_interval must be > 0 seconds, got {monitoring_interval!r}.")
        check_choice("scaling_strategy", scaling_strategy, _STRATEGIES)
        check_int("global_batch_size", global_batch_size, allowed=(None,))
        self.monitoring_interval, self.scaling_threshold = float(monitoring_interval), float(scaling_threshold)
        self.scaling_strategy, self.min_nodes, self.max_nodes = scaling_strategy, min_nodes, max_nodes
        self.global_batch_size, self.on_decision, self.decisions_file = global_batch_size, on_decision, decisions_file
        self.decisions: list[ScaleDecision] = []
        self.lr_scale = 1.0
        self._preempted = False
        self._previous_handler: Any = None
        self._last_decision = 0.0
        self._cursor = 0
        self._nodes = 1
        self._failed = False
        self._vote: Optional[StepVote] = None

    @property
    def nodes(self) -> int:
        return int(os.environ.get("GROUP_WORLD_SIZE", 0)) or self._nodes

    # -- set-up ------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not any(isinstance(c, SnapshotRecovery) for c in trainer.callbacks):
            raise ValueError(
                "ElasticResourceManager restores restarted workers through SnapshotRecovery: add"
                " SnapshotRecovery(...) to the Trainer's callbacks (and an AsyncCheckpointer for a fallback)."
            )
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
            rank_zero_warn(
                "ElasticResourceManager: TorchElastic shares its rendezvous store with the workers; a node that joins"
                " after a membership change then waits forever for the master address (pytorch#135712). Start"
                " torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment."
            )
        self._nodes = max(1, trainer.num_nodes)
        if not self.min_nodes <= self.nodes <= self.max_nodes:
            rank_zero_warn(f"ElasticResourceManager: running on {self.nodes} nodes, outside min_nodes..max_nodes = {self.min_nodes}..{self.max_nodes}.")
        self._vote = step_vote(trainer)
        self._vote.register(_VOTE, 2, self._local_flags)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._keep_global_batch(trainer)
        self._last_decision = time.monotonic()
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)  # after Lightning installed its own
        rank_zero_info(
            f"ElasticResourceManager: {self.nodes} nodes, {trainer.world_size} ranks, global batch"
            f" {self.global_batch_size} (accumulate_grad_batches={trainer.accumulate_grad_batches})."
        )

    def _keep_global_batch(self, trainer: Trainer) -> None:
        per_rank = _per_rank_batch(trainer.train_dataloader)
        dp = parallel_context(trainer).dims.dp
        if per_rank is None:
            rank_zero_warn("ElasticResourceManager: cannot read the per-rank batch size; the global batch follows the node count.")
            return
        if self.global_batch_size is None:
            self.global_batch_size = per_rank * dp * trainer.accumulate_grad_batches
        accumulate = max(1, round(self.global_batch_size / (per_rank * dp)))
        actual = per_rank * dp * accumulate
        trainer.accumulate_grad_batches = accumulate
        if actual != self.global_batch_size:
            factor = actual / self.global_batch_size
            _scale_learning_rate(trainer, factor / self.lr_scale)
            self.lr_scale = factor
            rank_zero_warn(
                f"ElasticResourceManager: global batch {self.global_batch_size} is not a multiple of {per_rank} x {dp}"
                f" ranks; using {actual} ({accumulate} accumulation steps) and the learning rate x {factor:.3g}"
                " (linear scaling rule)."
            )
        elif self.lr_scale != 1.0:
            _scale_learning_rate(trainer, 1.0 / self.lr_scale)
            self.lr_scale = 1.0

    def _local_flags(self, trainer: Trainer, pl_module: LightningModule, outputs: Any) -> tuple[bool, bool]:
        """This rank's vote: (SIGTERM received, rank 0's decision interval has passed)."""
        due = trainer.is_global_zero and time.monotonic() - self._last_decision >= self.monitoring_interval
        return self._preempted, due

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._preempted = True

    # -- every step: preemption and monitoring, decided together -----------------------------------------
    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        telemetry = Telemetry.of(trainer)
        telemetry.end()
        preempted, due = (flag > 0 for flag in batch_end_vote(trainer, _VOTE, pl_module, outputs, batch_idx))
        if preempted:
            self._leave(trainer, pl_module)
        if due:
            self._last_decision = time.monotonic()
            self._decide(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        Telemetry.of(trainer).begin(trainer.global_step, batch_idx, batch)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        Telemetry.of(trainer).before_optimizer_step()

    def _leave(self, trainer: Trainer, pl_module: LightningModule) -> None:
        recovery = next(c for c in trainer.callbacks if isinstance(c, SnapshotRecovery))
        recovery.snapshot_now(trainer, pl_module)
        raise NodePreempted(
            f"SIGTERM seen at step {trainer.global_step}: snapshot taken; leaving so TorchElastic re-forms the group."
        )

    def _decide(self, trainer: Trainer, pl_module: LightningModule) -> None:
        records, self._cursor = Telemetry.of(trainer).records_since(self._cursor)
        steps = sum(r.optimizer_step for r in records)
        node = int(os.environ.get("GROUP_RANK", trainer.node_rank))
        row = [
            float(node), float(sum(r.samples for r in records)), sum(r.compute for r in records), float(steps),
            sum(r.duration + r.data_wait for r in records), sum(r.sync_wait for r in records),
        ]
        rows = gather_per_rank(trainer, row)
        if not steps or rows[:, 3].min() <= 0:
            return
        speeds: dict[int, float] = {}
        samples: dict[int, int] = {}
        for node_id, n, compute, *_ in rows.tolist():
            speeds[int(node_id)] = speeds.get(int(node_id), 0.0) + (n / compute if compute > 0 else 0.0)
            samples[int(node_id)] = samples.get(int(node_id), 0) + int(n)
        windows = [NodeWindow(k, samples[k], samples[k] / speeds[k]) for k in sorted(speeds) if speeds[k] > 0]
        step_seconds = float(rows[:, 4].max() / rows[:, 3].max())
        sync_seconds = float(rows[:, 5].mean() / rows[:, 3].max())
        global_batch = sum(samples.values()) / float(rows[:, 3].max())
        decision = decide(windows, step_seconds, sync_seconds, global_batch, self.scaling_threshold, self.min_nodes, self.max_nodes)
        self.decisions.append(decision)
        pl_module.log_dict(
            {
                "elastic/nodes": float(decision.nodes),
                "elastic/throughput": decision.throughput,
                "elastic/efficiency": decision.efficiency,
                "elastic/target_nodes": float(decision.target_nodes),
            },
            on_step=True, on_epoch=False, rank_zero_only=True,
        )
        if not trainer.is_global_zero:
            return
        rank_zero_info(f"ElasticResourceManager: step {trainer.global_step}: {decision.action} ({decision.reason}).")
        record = dict(decision.as_dict(), step=trainer.global_step, time=time.time())
        path = self.decisions_path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as file:
            file.write(json.dumps(record) + "\n")
        if self.on_decision is not None:
            self.on_decision(decision)

    def decisions_path(self, trainer: Trainer) -> Path:
        """``decisions_file``; a relative one beside the run's logs (the logger's ``log_dir``), or under
        ``default_root_dir`` without a logger: never the current directory by default (a user's source tree)."""
        path = Path(self.decisions_file)
        return path if path.is_absolute() else Path(trainer.log_dir or trainer.default_root_dir) / path

    # -- teardown and state ------------------------------------------------------------------------------
    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._failed = True

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        if self._vote is not None:
            self._vote.release(_VOTE, peer_may_be_gone=self._failed)
            self._vote = None
        Telemetry.release(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"global_batch_size": self.global_batch_size, "lr_scale": self.lr_scale}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.global_batch_size = state_dict.get("global_batch_size", self.global_batch_size)
        self.lr_scale = float(state_dict.get("lr_scale", 1.0))


def _per_rank_batch(loader: Any) -> Optional[int]:
    if getattr(loader, "batch_size", None):
        return int(loader.batch_size)
    sampler = getattr(loader, "batch_sampler", None)
    while sampler is not None:
        if getattr(sampler, "batch_size", None):
            return int(sampler.batch_size)
        sampler = getattr(sampler, "batch_sampler", None)
    return None


def _scale_learning_rate(trainer: Trainer, factor: float) -> None:
    if math.isclose(factor, 1.0):
        return
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
    for config in trainer.lr_scheduler_configs:
        if hasattr(config.scheduler, "base_lrs"):
            config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]
