"""A small training job for real `torchrun` restart tests: ``torchrun ... restart_job.py OUT_DIR [options]``.

Trains the tiny DeepSeek-style model with ``strategy="ciuic"`` and :class:`SnapshotRecovery`; optionally a fault
is injected (``--fault kill --fault-step N --fault-rank R``). Rank 0 writes ``OUT_DIR/final.pt`` (the trained
weights) and every rank writes ``OUT_DIR/rank<r>.json`` (restart attempt, where it resumed from, shm directory).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from lightning_ciuic.callbacks.async_checkpoint import AsyncCheckpointer
from lightning_ciuic.callbacks.recovery import SnapshotRecovery
from lightning_ciuic.testing import FailAt
from tests.helpers import TINY_MODEL, loader


class SavesCommittedBefore(Callback):
    """At the start of step ``step``, wait until the background checkpoint writes begun so far are committed, so
    "the last checkpoint" a fault in that step leaves is the same however loaded the machine is."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.step:
            trainer.strategy.checkpoint_io.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--snapshot-freq", type=int, default=4)
    parser.add_argument("--store", default="shm")
    parser.add_argument("--shm-root", default=None)
    parser.add_argument("--fault", default=None)
    parser.add_argument("--fault-step", type=int, default=7)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--lose-snapshots", action="store_true")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--sharded", action="store_true", help="FSDP over both ranks (data_parallel_shard_size='auto')")
    args = parser.parse_args()

    torch.set_num_threads(1)
    seed_everything(0)
    recovery = SnapshotRecovery(snapshot_freq=args.snapshot_freq, store=args.store, shm_root=args.shm_root)
    callbacks = [recovery]
    if args.checkpoint_dir:
        callbacks.append(AsyncCheckpointer(args.checkpoint_dir, every_n_train_steps=args.snapshot_freq))
        if args.fault:
            callbacks.append(SavesCommittedBefore(args.fault_step))  # before FailAt: runs first
    if args.fault:
        callbacks.append(FailAt(args.fault_step, args.fault, ranks=(args.fault_rank,), lose_snapshots=args.lose_snapshots))
    trainer = Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=HybridParallelStrategy(data_parallel_shard_size="auto") if args.sharded else "ciuic",
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.checkpoint_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DeepSeekMini(**TINY_MODEL)
    trainer.fit(model, loader(512, 4))
    args.out.mkdir(parents=True, exist_ok=True)
    # The whole model (a sharded one gathered: collective), saved by rank 0.
    final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) if args.sharded else model.state_dict()
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in final.items()}, args.out / "final.pt")
    report = {
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "restored_from": recovery.restored_from,
        "run_directory": str(recovery.run_directory),
        "global_step": trainer.global_step,
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
