"""Pipeline parallelism in Lightning's loop: every schedule trains like single-process training."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from tests.helpers import TINY_MODEL, assert_state_close, loader, reference_training, run_workers

STEPS, PER_RANK_BATCH = 20, 4


class GlobalLoss(DeepSeekMini):
    """Logs the loss averaged over data-parallel replicas: the loss of the global batch, as one process sees it."""

    def training_step(self, batch, batch_idx):
        loss = self.pipelined_loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss


def _tiny() -> DeepSeekMini:
    seed_everything(7)
    return GlobalLoss(**TINY_MODEL)


def _logged_losses(save_dir: Path) -> list[float]:
    (metrics,) = save_dir.rglob("metrics.csv")
    with metrics.open() as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def fit_pipelined(tmp_path: Path, strategy: HybridParallelStrategy, dp: int, steps: int = STEPS, **trainer_kwargs):
    """Train the tiny model; returns (full state dict handed back to this process, logged per-step losses)."""
    module = _tiny()
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_steps=steps, logger=CSVLogger(tmp_path),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, loader(steps * PER_RANK_BATCH * dp, PER_RANK_BATCH))
    return {k: v.detach() for k, v in module.state_dict().items()}, _logged_losses(tmp_path)


SCHEDULES = [
    ("gpipe", None), ("1f1b", None), ("interleaved_1f1b", 2), ("looped_bfs", 2),
    ("interleaved_zero_bubble", 2), ("zbv_zero_bubble", None), ("dualpipev", None),
]


class _LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _every_schedule(rank: int, world: int, dp: int, tp: int, clip) -> None:
    """In already started processes (Lightning sees them as launched externally), train the tiny model with
    every schedule and compare each rank's loss trajectory and stage parameters with single-process training."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    expected_losses: list[float] = []
    expected = reference_training(_tiny, STEPS, PER_RANK_BATCH * dp, clip=clip, losses=expected_losses)
    for schedule, stages_per_rank in SCHEDULES:
        strategy = HybridParallelStrategy(
            pipeline_parallel_size=2, data_parallel_size=dp, tensor_parallel_size=tp, pipeline_schedule=schedule,
            stages_per_rank=stages_per_rank, num_microbatches=4 if schedule == "dualpipev" or tp > 1 else 2,
            gradient_checkpointing=schedule == "1f1b",
        )
        module, recorder = _tiny(), _LossRecorder()
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS, logger=False, callbacks=[recorder],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            gradient_clip_val=clip,
        )
        trainer.fit(module, loader(STEPS * PER_RANK_BATCH * dp, PER_RANK_BATCH))
        assert recorder.losses == pytest.approx(expected_losses, rel=1e-4), schedule
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        assert state.keys() < expected.keys(), f"{schedule}: a stage holds part of the model, under its own names"
        assert_state_close(state, {k: expected[k] for k in state})


@pytest.mark.parametrize("dp, tp, clip", [(2, 1, None), (1, 2, 0.05)], ids=["pp2xdp2", "pp2xtp2-clip"])
def test_every_schedule_matches_single_process(dp, tp, clip):
    """pp=2 x dp=2 and pp=2 x tp=2 (global-norm clipping) on 4 processes, 20 steps, for each schedule offered;
    1F1B also with activation checkpointing."""
    run_workers(_every_schedule, 4, dp, tp, clip)


def test_full_model_is_handed_back_after_spawn(tmp_path):
    """With start_method="spawn" the main process gets every stage's trained weights back, and the logged loss
    is the true loss on every rank."""
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, start_method="spawn")
    state, losses = fit_pipelined(tmp_path, strategy, dp=2, steps=6)
    expected_losses: list[float] = []
    expected = reference_training(_tiny, 6, PER_RANK_BATCH * 2, losses=expected_losses)
    assert losses == pytest.approx(expected_losses, rel=1e-4)
    assert_state_close(state, expected)
