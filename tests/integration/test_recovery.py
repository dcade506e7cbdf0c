"""SnapshotRecovery in-process rollbacks through Lightning (spawned ranks): the run goes on without a restart and
ends where single-process training on the same batches, less the skipped ones, ends."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from lightning_ciuic.callbacks.async_checkpoint import AsyncCheckpointer
from lightning_ciuic.callbacks.elastic import ElasticResourceManager
from lightning_ciuic.callbacks.recovery import SnapshotRecovery
from lightning_ciuic.strategies.context import step_vote
from lightning_ciuic.testing import FailAt
from tests.helpers import PRECISION, TINY_MODEL, assert_state_close, loader, reference_training

STEPS, PER_RANK_BATCH, DP = 10, 2, 2
NUM_SAMPLES = 16 * PER_RANK_BATCH * DP  # 16 global batches: room for the skipped ones


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return DeepSeekMini(**TINY_MODEL).double()


def _tiny_moe() -> DeepSeekMini:  # experts expert_parallel_size=2 divides
    seed_everything(7)
    return DeepSeekMini(**{**TINY_MODEL, "n_routed_experts": 4}).double()


def _fit(
    callbacks: list[Callback], strategy: object, devices: int = DP, factory=_tiny
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    module = factory()
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False, enable_model_summary=False, precision=PRECISION,
    )
    trainer.fit(module, loader(NUM_SAMPLES, PER_RANK_BATCH))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {k: v.detach() for k, v in module.state_dict().items()}, metrics


def _expected(batches: list[int], factory=_tiny) -> dict[str, torch.Tensor]:
    assert len(batches) == STEPS
    return reference_training(factory, STEPS, PER_RANK_BATCH * DP, batches=batches, num_samples=NUM_SAMPLES)


def _ciuic(tp: int = 1, shard: int = 1, ep: int = 1) -> HybridParallelStrategy:
    return HybridParallelStrategy(
        data_parallel_size=DP, tensor_parallel_size=tp, data_parallel_shard_size=shard, expert_parallel_size=ep,
        start_method="forkserver",
    )


@pytest.mark.parametrize("layout", ["ciuic-dp2", "ciuic-dp2xtp2", "ciuic-fsdp2", "ciuic-fsdp2-ep2", "ddp"])
def test_nan_gradient_rolls_back_and_skips_the_batches_since_the_snapshot(layout):
    recovery = SnapshotRecovery(snapshot_freq=3, store="memory", check_gradients=True)
    strategy = {
        "ciuic-dp2": _ciuic(), "ciuic-dp2xtp2": _ciuic(tp=2), "ciuic-fsdp2": _ciuic(shard=2),
        "ciuic-fsdp2-ep2": _ciuic(shard=2, ep=2), "ddp": "ddp_spawn",
    }[layout]
    devices = 4 if layout == "ciuic-dp2xtp2" else DP
    factory = _tiny_moe if layout.endswith("ep2") else _tiny
    actual, metrics = _fit([recovery, FailAt(8, "nan", ranks=(1,)), CheckRuns()], strategy, devices, factory)
    # Snapshots at steps 3 and 6; step 8 (global batch 7) is poisoned on rank 1 -> back to step 6: the batches of
    # steps 7 and 8 are skipped, and steps 7..10 train on batches 8..11.
    assert metrics["recovery/rollbacks"] == 1
    if layout == "ciuic-dp2xtp2":  # the tp peers' batches compared at the first step and again after the rollback
        assert metrics["batch_check/runs"] == 2
    assert_state_close(actual, _expected([0, 1, 2, 3, 4, 5, 8, 9, 10, 11], factory), STEPS)


class CheckRuns(Callback):
    """Reports how many times the equal-batch check compared the replicas' batches (``batch_check/runs``)."""

    def on_train_end(self, trainer, pl_module):
        check = getattr(trainer.strategy, "batch_check", None)
        trainer.callback_metrics["batch_check/runs"] = torch.tensor(float(check.runs if check is not None else -1))


class VoteRounds(Callback):
    """Reports how many exchanges the Trainer's per-step vote made (``vote/rounds`` in callback_metrics)."""

    def on_train_end(self, trainer, pl_module):
        trainer.callback_metrics["vote/rounds"] = torch.tensor(float(step_vote(trainer).rounds))


def test_recovery_elastic_and_checkpointer_agree_in_one_exchange_per_batch(tmp_path):
    callbacks = [
        SnapshotRecovery(snapshot_freq=3, store="memory", check_gradients=True),
        ElasticResourceManager(min_nodes=1, monitoring_interval=3600),
        AsyncCheckpointer(str(tmp_path / "checkpoints"), save_interval=None, every_n_train_steps=2),
        FailAt(8, "nan", ranks=(1,)),
        VoteRounds(),
    ]
    actual, metrics = _fit(callbacks, _ciuic())
    # 12 batches (8, a rollback to step 6, then 4), each agreed by the three callbacks in one exchange.
    assert metrics["recovery/rollbacks"] == 1 and metrics["vote/rounds"] == 12
    assert_state_close(actual, _expected([0, 1, 2, 3, 4, 5, 8, 9, 10, 11]), STEPS)


def test_min_loss_rolls_back_to_the_snapshot_with_the_lowest_loss():
    losses: list[float] = []
    reference_training(_tiny, 6, PER_RANK_BATCH * DP, num_samples=NUM_SAMPLES, losses=losses)
    assert losses[2] < losses[5], "the data make 'min_loss' and 'latest' choose differently"
    recovery = SnapshotRecovery(snapshot_freq=3, store="memory", check_gradients=True, recovery_strategy="min_loss")
    actual, metrics = _fit([recovery, FailAt(8, "nan", ranks=(1,))], _ciuic())
    # Snapshots at steps 3 and 6, step 3's with the lower loss: back to step 3, steps 4..10 on batches 8..14.
    assert metrics["recovery/rollbacks"] == 1
    assert_state_close(actual, _expected([0, 1, 2, 8, 9, 10, 11, 12, 13, 14]), STEPS)


def test_non_finite_loss_after_a_poisoned_update_rolls_back():
    recovery = SnapshotRecovery(snapshot_freq=3, store="memory")  # check_gradients=False, the default
    actual, metrics = _fit([recovery, FailAt(8, "nan", ranks=(0,))], _ciuic())
    # Without the gradient check the NaN update lands; step 9's loss is NaN -> back to step 6, skipping 3 batches.
    assert metrics["recovery/rollbacks"] == 1
    assert_state_close(actual, _expected([0, 1, 2, 3, 4, 5, 9, 10, 11, 12]), STEPS)


class CorruptNewestSnapshot(Callback):
    """At ``step``, flip a byte in the payload of rank ``rank``'s newest shared-memory snapshot."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            recovery = next(c for c in trainer.callbacks if isinstance(c, SnapshotRecovery))
            newest = sorted(recovery.store.directory.glob("*.snap"))[-1]
            data = bytearray(newest.read_bytes())
            data[-100] ^= 0xFF
            newest.write_bytes(bytes(data))


def test_corrupt_snapshot_is_detected_and_the_next_one_used_and_shared_memory_released(tmp_path):
    recovery = SnapshotRecovery(snapshot_freq=2, max_snapshots=3, store="shm", shm_root=str(tmp_path), check_gradients=True)
    callbacks = [recovery, CorruptNewestSnapshot(step=7, rank=0), FailAt(8, "nan", ranks=(1,))]
    actual, metrics = _fit(callbacks, _ciuic())
    # Kept: steps 2, 4, 6. Rank 0's step-6 snapshot fails its CRC -> every rank uses step 4; steps 5..8 skipped.
    assert metrics["recovery/rollbacks"] == 1
    assert_state_close(actual, _expected([0, 1, 2, 3, 8, 9, 10, 11, 12, 13]), STEPS)
    deadline = time.monotonic() + 10  # the run's directory goes with the process that owned it
    while list(Path(tmp_path).iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(Path(tmp_path).iterdir()) == []


class PoisonFrom(Callback):
    """NaN gradients on every step from optimizer step ``step`` on."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step + 1 >= self.step:
            loss.register_hook(lambda grad: grad * float("nan"))


@pytest.mark.parametrize(
    ("poison_from", "message"),
    [(3, "step 3 is bad \\(non-finite gradient\\) after 2 rollbacks without a new snapshot"), (1, "no snapshot can be loaded")],
)
def test_faults_that_recovery_cannot_fix_stop_the_run_with_a_clear_error(poison_from, message):
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[
            SnapshotRecovery(snapshot_freq=1, store="memory", max_rollbacks=2, check_gradients=True),
            PoisonFrom(poison_from),
        ],
    )
    with pytest.raises(RuntimeError, match=message):
        trainer.fit(_tiny(), loader(NUM_SAMPLES, PER_RANK_BATCH))
