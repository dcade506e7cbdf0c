"""A small elastic training job for real TorchElastic tests: ``torchrun --nnodes=MIN:MAX ... elastic_job.py OUT_DIR``.

Trains the tiny DeepSeek-style model with ``strategy="ciuic"`` (data parallel over every rank),
``SnapshotRecovery`` and ``ElasticResourceManager``; each step is paced (``--step-seconds``) so a test can act in
the middle of the run. Every rank appends one JSON line per optimizer step to ``OUT_DIR/progress.jsonl`` (time,
step, world size, restart attempt); at the end rank 0 writes ``OUT_DIR/final.json`` with the loss on a fixed
held-out batch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic.callbacks.elastic import ElasticResourceManager
from lightning_ciuic.callbacks.recovery import SnapshotRecovery
from tests.helpers import TINY_MODEL, TokenWindows, loader


class Progress(Callback):
    def __init__(self, path: Path, step_seconds: float) -> None:
        self.path, self.step_seconds, self._last = path, step_seconds, -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.step_seconds)
        if trainer.global_step == self._last:
            return
        self._last = trainer.global_step
        record = {
            "time": time.time(), "step": trainer.global_step, "world": trainer.world_size, "rank": trainer.global_rank,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "accumulate": trainer.accumulate_grad_batches,
        }
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--snapshot-freq", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(1)
    seed_everything(0)
    callbacks = [
        SnapshotRecovery(snapshot_freq=args.snapshot_freq, store="shm"),
        ElasticResourceManager(monitoring_interval=2.0, min_nodes=1, max_nodes=2, global_batch_size=8,
                               decisions_file=str(args.out / "decisions.jsonl")),
        Progress(args.out / "progress.jsonl", args.step_seconds),
    ]
    trainer = Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), strategy="ciuic", max_steps=args.steps,
        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DeepSeekMini(**TINY_MODEL)
    trainer.fit(model, loader(8 * 200, 4))  # per-rank batch 4, global batch 8: accumulation 2 on one rank
    if trainer.global_rank == 0:
        held_out = TokenWindows(64, seed=123)
        with torch.no_grad():
            loss = float(model._loss((held_out.data[:, :-1], held_out.data[:, 1:])))
        (args.out / "final.json").write_text(json.dumps({"loss": loss, "world": trainer.world_size, "step": trainer.global_step}))


if __name__ == "__main__":
    main()
