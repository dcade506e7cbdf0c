"""Pipeline parallelism in Lightning's loop: every schedule trains like single-process training."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from tests.helpers import TINY_MODEL, assert_state_close, loader, reference_training

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


@pytest.mark.parametrize("schedule, stages_per_rank", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_pp2_dp2_matches_single_process(tmp_path, schedule, stages_per_rank):
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2, data_parallel_size=2, pipeline_schedule=schedule, stages_per_rank=stages_per_rank,
        num_microbatches=4 if schedule == "dualpipev" else 2, start_method="spawn",
    )
    state, losses = fit_pipelined(tmp_path, strategy, dp=2)
    expected_losses: list[float] = []
    expected = reference_training(_tiny, STEPS, PER_RANK_BATCH * 2, losses=expected_losses)
    assert losses == pytest.approx(expected_losses, rel=1e-4)
    assert_state_close(state, expected)
