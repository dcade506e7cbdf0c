"""SnapshotRecovery (seed name ``QuantumRecovery``): in-memory snapshots, rollback on bad steps, resume after restarts.

Contract:

* Snapshot: every ``snapshot_freq`` optimizer steps (at the end of the batch, after the optimizer and scheduler
  step) each rank captures its whole training state: its share of the model and of every optimizer's state, LR
  schedulers, gradient-compression residuals (``HybridParallelStrategy``), the fit loop's progress (step, epoch,
  position in the epoch), every other callback's state and the RNG states. The data position is exact: the
  strategy keeps a map-style training DataLoader as a :class:`~lightning_ciuic.data.resume.PositionedDataLoader`
  (:func:`~lightning_ciuic.data.resume.keep_position`), so a resume continues the epoch with the next unseen batch;
  a loader over an ``IterableDataset`` with ``state_dict`` / ``load_state_dict`` (LitData's ``StreamingDataLoader``,
  torchdata's ``StatefulDataLoader``) keeps its own position in the fit loop's state, any other restarts its epoch
  (said once). The snapshot is encoded (``state_compression``), sealed with a
  CRC, and kept in the ``store``; the newest ``max_snapshots`` are kept.

  - ``"memory"``: this process's memory (in-process rollback only).
  - ``"shm"`` (default): shared memory, ``/dev/shm``: also survives a worker restart on the same node.
  - ``"peer"``: shared memory, plus a copy in the shared memory of a peer rank on another node
    (:func:`~lightning_ciuic.checkpoint.snapshot.peer_of`): also survives losing the node.

* Health check, every optimizer step, decided together by all ranks: the step is bad when any rank's loss is
  non-finite, or the mean loss exceeds ``loss_spike_factor`` times the median of the last ``spike_window``
  healthy steps' mean losses (checked once 10 of them are known; ``None`` turns the spike rule off), or, with
  ``check_gradients``, any rank's gradient norm is non-finite (one more pass over the gradients each step).
  Without it a non-finite gradient is caught one step later, by the loss its poisoned update produces; either
  way a snapshot is only taken of finite parameters.
* Rollback (no restart): after a bad step the state returns to a kept snapshot chosen by ``recovery_strategy``
  (``"latest"``: the newest; ``"min_loss"``: the lowest recorded loss, newest first among equals), and
  ``trainer.global_step`` returns to the snapshot's step, so ``max_steps`` still counts applied updates. The data
  does not rewind: the offending batch and the ones since the snapshot are skipped (as PaLM and OPT did after
  loss spikes) and recorded in :attr:`events`. A snapshot that fails its check is reported and the next
  candidate is used. More than ``max_rollbacks`` rollbacks without a new snapshot in between stop the run with
  an error instead of looping.
* Resume at the start of ``fit``: the newest snapshot every rank can load (own shared memory, else the peer's
  copy), else the newest checkpoint of an :class:`~lightning_ciuic.callbacks.async_checkpoint.AsyncCheckpointer`
  in the run, else nothing (training starts fresh). When, by ``resume``:

  - ``"restart"`` (default): only on a TorchElastic restart (``torchrun --max-restarts``, elastic nodes): some rank
    has ``TORCHELASTIC_RESTART_COUNT`` > 0, or, under TorchElastic, some rank finds snapshots of this run kept by
    the previous attempt (a restart for a change of membership, which TorchElastic does not count). A fresh launch
    starts from scratch even beside a directory of checkpoints; one line says so and how to resume it.
  - ``"always"``: on every launch, a fresh one included.
  - ``"never"``: never (rollbacks only).

  Never when ``fit`` is given a ``ckpt_path``: Lightning loads that checkpoint, and only that one. The decision
  waits until ``trainer.ckpt_path`` is known, whatever the order of the callbacks and whichever of them sets up the
  training loader first: at ``on_fit_start`` where Lightning restores ``ckpt_path`` before it
  (``restore_checkpoint_after_setup`` is False, e.g. DDP); under ``HybridParallelStrategy`` (which loads
  checkpoints into the set-up model after ``on_fit_start``) at the point it announces once that restore is over
  (:mod:`lightning_ciuic.strategies.restore_point`), before the sanity check and the fit loop; under another
  strategy that restores after set-up, when Lightning sets up the training loader. A resume is said in one line
  (what was loaded, its step, why). A restart into a different data-parallel size (elastic nodes; ``pp`` and
  ``tp`` unchanged) restores from a data-parallel replica's snapshot, sent by the rank that holds it; compression
  residuals then start at zero.
* Shared memory is released: each rank's snapshots when ``fit`` finishes or fails for good, and the run's
  directory by a reaper when the TorchElastic agent (or the launching process) exits, whatever killed it.
* Logged: ``recovery/rollbacks`` and ``recovery/snapshot_step``; :attr:`snapshot_seconds` sums the time spent
  taking snapshots on this rank.

What a snapshot holds and how it goes back into the Trainer: :mod:`lightning_ciuic.callbacks.trainer_state`.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ciuic.comm.vote import StepVote
from lightning_ciuic.timeline import timeline
from lightning_ciuic.callbacks.train_loader import add_train_loader_transform, remove_train_loader_transform
from lightning_ciuic.checkpoint.snapshot import (
    COMPRESSIONS,
    MemoryStore,
    ShmStore,
    StateCompression,
    claim_run_directory,
    encode_snapshot,
    exchange,
    recovery_order,
)
from lightning_ciuic.callbacks.snapshot_restore import decode_agreed, restore_from_checkpoint, restore_newest
from lightning_ciuic.callbacks.trainer_state import apply_training_state, capture_training_state
from lightning_ciuic.strategies.restore_point import announces_restore
from lightning_ciuic import compat
from lightning_ciuic.strategies.context import batch_end_vote, parallel_context, step_vote
from lightning_ciuic.tensors import local_tensor
from lightning_ciuic.validation import check_choice, check_int

RecoveryStrategy = Literal["latest", "min_loss"]
SnapshotStoreKind = Literal["memory", "shm", "peer"]
ResumeWhen = Literal["restart", "always", "never"]
_STRATEGIES = ("latest", "min_loss")
_STORES = ("memory", "shm", "peer")
_RESUMES = ("restart", "always", "never")
_MIN_SPIKE_HISTORY = 10
_VOTE = "SnapshotRecovery"  # its slot in the per-step vote


@dataclass
class RecoveryEvent:
    """One rollback: the bad step, why, the snapshot step it went back to and the steps it undid."""

    step: int
    epoch: int
    batch_idx: int
    reason: str
    restored_step: int
    skipped_steps: int  # optimizer steps undone, the bad one included
    seconds: float


class SnapshotRecovery(Callback):
    """Snapshots of the training state and recovery from faults; see the module docstring.

    Args:
        snapshot_freq: optimizer steps between snapshots.
        state_compression: ``"none"`` or ``"zstd"`` (fp32 state shrinks by ~8%, and a restore takes ~4x longer).
        max_snapshots: snapshots kept per rank.
        recovery_strategy: ``"latest"`` or ``"min_loss"``.
        store: ``"memory"``, ``"shm"`` or ``"peer"``.
        loss_spike_factor: a mean loss above this times the recent median is a spike (``None``: no spike rule).
        spike_window: healthy steps the median is taken over.
        check_gradients: also check every rank's gradient norm each step (catches a NaN one step earlier).
        max_rollbacks: rollbacks allowed without a new snapshot in between.
        shm_root: where shared-memory snapshots live (default ``/dev/shm``, else the temp directory).
        run_id: names the snapshot directory; default: TorchElastic's run id and agent, else this launch.
        resume: when ``fit`` resumes by itself: ``"restart"`` (a TorchElastic restart), ``"always"`` (every launch:
            also a fresh one, from the last ``AsyncCheckpointer`` checkpoint) or ``"never"``. A ``ckpt_path`` given
            to ``fit`` always wins.
    """

    def __init__(
        self,
        snapshot_freq: int = 500,
        state_compression: StateCompression = "none",
        max_snapshots: int = 3,
        recovery_strategy: RecoveryStrategy = "latest",
        store: SnapshotStoreKind = "shm",
        loss_spike_factor: Optional[float] = 4.0,
        spike_window: int = 50,
        check_gradients: bool = False,
        max_rollbacks: int = 3,
        shm_root: Optional[str] = None,
        run_id: Optional[str] = None,
        resume: ResumeWhen = "restart",
    ) -> None:
        for name, value in (("snapshot_freq", snapshot_freq), ("max_snapshots", max_snapshots), ("spike_window", spike_window), ("max_rollbacks", max_rollbacks)):
            check_int(name, value)
        check_choice("state_compression", state_compression, COMPRESSIONS)
        check_choice("recovery_strategy", recovery_strategy, _STRATEGIES)
        check_choice("store", store, _STORES)
        check_choice("resume", resume, _RESUMES)
        if loss_spike_factor is not None and not loss_spike_factor > 1:
            raise ValueError(f"loss_spike_factor must be > 1 (or None to turn the spike rule off), got {loss_spike_factor!r}.")
        self.snapshot_freq, self.state_compression, self.max_snapshots = snapshot_freq, state_compression, max_snapshots
        self.recovery_strategy, self.store_kind = recovery_strategy, store
        self.loss_spike_factor, self.spike_window, self.check_gradients = loss_spike_factor, spike_window, check_gradients
        self.max_rollbacks = max_rollbacks
        self.shm_root = shm_root or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.run_id, self.resume = run_id, resume
        self.events: list[RecoveryEvent] = []
        self.restored_from: Optional[str] = None
        self.snapshot_seconds = 0.0
        self.store: Optional[MemoryStore] = None
        self.replicas: Optional[MemoryStore] = None
        self.run_directory: Optional[Path] = None
        self._vote: Optional[StepVote] = None
        self._losses: deque[float] = deque(maxlen=spike_window)
        self._last_step = -1
        self._rollbacks_since_snapshot = 0
        self._failed = False
        self._resume_pending = False  # on_fit_start ran, the resume decision has not been made yet

    # -- set-up and teardown ------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        add_train_loader_transform(trainer, self._train_loader)
        self._resume_pending = True  # decided once, when fit's own restore is over (see on_fit_start)
        self._vote = step_vote(trainer)
        self._vote.register(_VOTE, 4, self._local_health)
        if self.store_kind == "memory":
            self.store = MemoryStore()
            return
        owner, key = self._owner_and_key(trainer)
        self.run_directory = claim_run_directory(Path(self.shm_root) / f"lightning_ciuic-{key}", owner)
        # By local rank: a restarted worker (whatever global rank it gets) finds what its slot on this node kept.
        self.store = ShmStore(self.run_directory / f"local{trainer.local_rank}")
        if self.store_kind == "peer":
            self.replicas = ShmStore(self.run_directory / f"replicas{trainer.local_rank}")
        rank_zero_info(f"SnapshotRecovery: {self.store_kind} snapshots in {self.run_directory}")

    def _owner_and_key(self, trainer: Trainer) -> tuple[int, str]:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # the agent (our parent) outlives every restart of the workers
            owner = os.getppid()
            return owner, self.run_id or f"{os.environ['TORCHELASTIC_RUN_ID']}-{owner}"
        owner = int(trainer.strategy.broadcast(os.getpid()))
        return owner, self.run_id or f"local-{owner}"

    def _train_loader(self, trainer: Trainer, loader: Any) -> Any:
        """Lightning sets up the training loader: under a strategy that restores after set-up and announces no end
        of it, resume first if still to be decided (see :meth:`on_fit_start`)."""
        if trainer.strategy.restore_checkpoint_after_setup and not announces_restore(trainer):
            self._resume_once(trainer)
        return loader

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._release()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._failed = True
        if not _restart_expected():  # no restart will come for these snapshots
            self._release()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        remove_train_loader_transform(trainer, self._train_loader)
        self._resume_pending = False
        if self._vote is not None:
            self._vote.release(_VOTE, peer_may_be_gone=self._failed)
            self._vote = None

    def _release(self) -> None:
        for store in (self.store, self.replicas):
            if store is not None:
                store.clear()

    # -- resume at the start of fit: after a restart, or when asked ------------------------------------
    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.strategy.restore_checkpoint_after_setup:
            self._resume_once(trainer)  # Lightning restored any ckpt_path before this hook: trainer.ckpt_path says
        # Else Lightning loads ckpt_path after this hook, so trainer.ckpt_path is not known yet (no public API names
        # the fit argument before): decided at on_fit_restored, or when the training loader is set up.

    def on_fit_restored(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """``HybridParallelStrategy``: Lightning's restore is over (``strategies/restore_point.py``)."""
        self._resume_once(trainer)

    def _resume_once(self, trainer: Trainer) -> None:
        if self._resume_pending:
            self._resume_pending = False
            self._resume(trainer, trainer.lightning_module)

    def _resume(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Collective: resume from the newest snapshot, else the last checkpoint, when the contract says so."""
        assert self.store is not None and self._vote is not None
        if trainer.ckpt_path is not None:  # the user's choice: Lightning loads it, and nothing else is loaded
            newest = max(self.store.headers(), default=None)
            if newest is not None:
                rank_zero_warn(
                    f"SnapshotRecovery: fit was given ckpt_path={trainer.ckpt_path!r}, which Lightning loads instead"
                    f" of the step-{newest} snapshot. Leave ckpt_path out to resume from snapshots after a restart."
                )
            return
        reason = self._resume_reason()
        if reason is None:
            self._say_not_resumed(trainer)
            return
        started = time.perf_counter()
        stores = {"own": self.store, "replica": self.replicas}
        restored = restore_newest(trainer, pl_module, stores, self._vote, parallel_context(trainer).dims, skip=self)
        if restored is not None:  # names its step
            self._last_step = trainer.global_step
            what = restored
        else:
            restored = restore_from_checkpoint(trainer)
            what = f"{restored} (step {trainer.global_step})"
        if restored is None:
            rank_zero_info(f"SnapshotRecovery: {reason}, but no snapshot or AsyncCheckpointer checkpoint to resume.")
            return
        self.restored_from = restored
        compat.load_pending_loader_states(trainer)  # a loader set up before this restore continues where it was
        rank_zero_info(f"SnapshotRecovery: resumed from {what} in {time.perf_counter() - started:.2f} s ({reason}).")

    def _resume_reason(self) -> Optional[str]:
        """Why this launch resumes, the same on every rank (collective under ``"restart"``), or ``None``."""
        if self.resume != "restart":
            return "resume='always'" if self.resume == "always" else None
        # TorchElastic counts failures only: a restart for a change of membership is known by the snapshots the
        # previous attempt kept (a new node's agent counts nothing at all, hence any rank).
        stores = (self.store, self.replicas)
        kept = "TORCHELASTIC_RUN_ID" in os.environ and any(store is not None and store.headers() for store in stores)
        reports = self._gather((_restart_count(), bool(kept)))
        restarts = max(count for count, _ in reports)
        if restarts > 0:
            return f"TorchElastic restart {restarts}"
        if any(kept for _, kept in reports):
            return "TorchElastic restarted the workers, and snapshots of this run are kept"
        return None

    def _say_not_resumed(self, trainer: Trainer) -> None:
        """One line when a checkpoint is there that this launch does not resume from, and how to resume it."""
        from lightning_ciuic.callbacks.async_checkpoint import AsyncCheckpointer

        checkpointer = next((c for c in trainer.callbacks if isinstance(c, AsyncCheckpointer)), None)
        if not trainer.is_global_zero or checkpointer is None:
            return
        manifests = checkpointer.io.catalog.manifests()
        if not manifests:
            return
        newest = manifests[-1]
        why = "resume='never'" if self.resume == "never" else "a fresh launch (not a TorchElastic restart)"
        how = "pass ckpt_path='last' to fit (CLI: --ckpt_path last)"
        if self.resume != "never":
            how += " or SnapshotRecovery(resume='always')"
        rank_zero_info(
            f"SnapshotRecovery: {why}: training starts from scratch, not from the checkpoint {newest.name} (step"
            f" {newest.step}) in {checkpointer.url}; to resume from it, {how}."
        )

    def snapshot_now(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Collective: take a snapshot of the current step now (e.g. before leaving on a preemption)."""
        self._snapshot(trainer, pl_module, trainer.global_step, self._losses[-1] if self._losses else None)

    # -- every step: health check, snapshot or rollback ----------------------------------------------
    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # an accumulation micro-batch: no optimizer step was taken
            return
        self._last_step = step
        reason, loss = self._health(trainer, pl_module, outputs, batch_idx)
        if reason is not None:
            self._rollback(trainer, pl_module, reason, batch_idx)
            return
        if loss is not None:
            self._losses.append(loss)
        if step % self.snapshot_freq == 0:
            self._snapshot(trainer, pl_module, step, loss)

    def _local_health(self, trainer: Trainer, pl_module: LightningModule, outputs: Any) -> tuple[float, ...]:
        """This rank's vote: (loss non-finite, gradient non-finite, loss, reports a loss)."""
        loss = _loss_of(outputs)
        grads_finite = True
        if self.check_gradients:
            grads_finite = _finite([p.grad for p in pl_module.parameters() if p.grad is not None])
        return (loss is not None and not math.isfinite(loss), not grads_finite, loss or 0.0, loss is not None)

    def _health(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch_idx: int) -> tuple[Optional[str], Optional[float]]:
        bad_loss, bad_grad, loss_sum, reporting = batch_end_vote(trainer, _VOTE, pl_module, outputs, batch_idx)
        if bad_loss:
            return "non-finite loss", None
        if bad_grad:
            return "non-finite gradient", None
        if not reporting:
            return None, None
        mean = loss_sum / reporting
        return loss_spike(mean, self._losses, self.loss_spike_factor), mean

    def _snapshot(self, trainer: Trainer, pl_module: LightningModule, step: int, loss: Optional[float]) -> None:
        assert self.store is not None
        started = time.perf_counter()
        problem = ""
        if not _finite([p for p in pl_module.parameters()]):
            problem = "non-finite parameters"  # a poisoned update the next step's loss check will roll back
        else:
            meta = {
                "step": step, "loss": loss, "epoch": trainer.current_epoch, "rank": trainer.global_rank,
                "world_size": trainer.world_size, "layout": parallel_context(trainer).dims.layout_key(trainer.global_rank),
            }
            state = capture_training_state(trainer, pl_module, skip=self)
            try:
                if self.replicas is None:
                    self.store.save(step, state, meta, self.state_compression)
                else:
                    blob = encode_snapshot(state, meta, self.state_compression)
                    self.store.put(step, blob)
            except OSError as error:  # e.g. shared memory full: keep training, say so
                problem = f"{type(error).__name__}: {error}"
        if problem:  # said by the rank it happened on, which may not be rank 0
            warnings.warn(f"SnapshotRecovery (rank {trainer.global_rank}): step-{step} snapshot not taken: {problem}.")
        if self._all_ok(not problem):
            if self.replicas is not None:
                local_world = self._local_world(trainer)
                self.replicas.put(step, exchange(blob, trainer.global_rank, trainer.world_size, local_world, self._group))
            self._prune()
            self._rollbacks_since_snapshot = 0
            pl_module.log("recovery/snapshot_step", float(step), on_step=True, on_epoch=False, rank_zero_only=True)
        else:
            self.store.drop(step)
            rank_zero_warn(f"SnapshotRecovery: no step-{step} snapshot ({problem or 'a problem on another rank'}); kept the older ones.")
        self.snapshot_seconds += time.perf_counter() - started
        timeline.record("snapshot", "snapshot", started)

    @staticmethod
    def _local_world(trainer: Trainer) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", trainer.num_devices))

    def _prune(self) -> None:
        for store in (self.store, self.replicas):
            if store is not None:
                for step in sorted(store.headers())[: -self.max_snapshots]:
                    store.drop(step)

    def _rollback(self, trainer: Trainer, pl_module: LightningModule, reason: str, batch_idx: int) -> None:
        assert self.store is not None
        started, step = time.perf_counter(), trainer.global_step
        if self._rollbacks_since_snapshot >= self.max_rollbacks:
            raise RuntimeError(
                f"SnapshotRecovery: step {step} is bad ({reason}) after {self._rollbacks_since_snapshot} rollbacks"
                f" without a new snapshot; stopping instead of looping. Lower the learning rate, check the data near"
                f" batch {batch_idx} of epoch {trainer.current_epoch}, or raise max_rollbacks."
            )
        headers = {  # this rank's own snapshots of this layout (not ones kept from before an elastic change)
            s: h for s, h in self.store.headers().items()
            if h.get("world_size") == trainer.world_size and h.get("rank") == trainer.global_rank
        }
        agreed = set.intersection(*(set(table) for table in self._gather(set(headers))))
        for candidate in recovery_order({s: headers[s].get("loss") for s in agreed}, self.recovery_strategy):
            state = decode_agreed(self._vote, self.store.get(candidate), f"snapshot of rank {trainer.global_rank} at step {candidate}")
            if state is None:
                continue
            apply_training_state(trainer, pl_module, state, rewind_only=True, skip=self)
            self._last_step = trainer.global_step
            self._rollbacks_since_snapshot += 1
            event = RecoveryEvent(step, trainer.current_epoch, batch_idx, reason, candidate, step - candidate, time.perf_counter() - started)
            self.events.append(event)
            rank_zero_warn(
                f"SnapshotRecovery: step {step} ({reason}): rolled back to step {candidate}; skipped batch {batch_idx}"
                f" of epoch {event.epoch} and the {event.skipped_steps - 1} optimizer steps before it."
            )
            pl_module.log("recovery/rollbacks", float(len(self.events)), on_step=True, on_epoch=False, rank_zero_only=True)
            return
        raise RuntimeError(f"SnapshotRecovery: step {step} is bad ({reason}) and no snapshot can be loaded on every rank.")

    # -- agreement between ranks ----------------------------------------------------------------------
    @property
    def _group(self) -> Optional[dist.ProcessGroup]:
        return self._vote.group if self._vote is not None else None

    def _gather(self, value: Any) -> list[Any]:
        assert self._vote is not None
        return self._vote.gather(value)

    def _all_ok(self, ok: bool) -> bool:
        assert self._vote is not None
        return self._vote.all_ok(ok)

    # -- checkpoints of the callback itself -----------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": [asdict(event) for event in self.events]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = [RecoveryEvent(**event) for event in state_dict.get("events", [])]


QuantumRecovery = SnapshotRecovery


def loss_spike(loss: float, history: Sequence[float], factor: Optional[float]) -> Optional[str]:
    """The spike rule: ``loss`` above ``factor`` times the median of ``history`` (the recent healthy losses),
    once at least 10 of them (or a full shorter window) are known. Meant for positive losses: with a median <= 0
    the rule does not apply. Returns the reason, or ``None``."""
    needed = min(_MIN_SPIKE_HISTORY, getattr(history, "maxlen", None) or _MIN_SPIKE_HISTORY)
    if factor is None or len(history) < needed:
        return None
    median = statistics.median(history)
    if median > 0 and loss > factor * median:
        return f"loss spike ({loss:.4g} > {factor} x median {median:.4g})"
    return None


def _finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of this rank's tensors (local shards) is finite: one pass, through their norm."""
    local = [local_tensor(t) for t in tensors]
    return not local or bool(torch.isfinite(torch.nn.utils.get_total_norm([t.detach() for t in local])))


def _loss_of(outputs: Any) -> Optional[float]:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(loss) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _restart_count() -> int:
    """This worker's TorchElastic restart attempt (0: the first, or not under TorchElastic)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _restart_expected() -> bool:
    """Whether TorchElastic will restart this worker after a failure (restarts left)."""
    restarts, limit = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    return restarts is not None and limit is not None and int(restarts) < int(limit)
