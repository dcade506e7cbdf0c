"""Elastic training demo: ``torchrun --nnodes=1:2 --rdzv-backend=c10d ... examples/elastic.py OUT_DIR``.

Trains a small DeepSeek-style model on the shipped corpus with ``strategy="ciuic"`` (data parallel over every
rank), ``SnapshotRecovery`` and ``ElasticResourceManager`` (global batch 8 kept whatever the number of nodes).
Each step can be paced (``--step-seconds``) to leave time to stop and start nodes by hand. Every rank appends one
JSON line per optimizer step to ``OUT_DIR/progress.jsonl`` (time, step, world size, restart attempt,
accumulation, the samples of the optimizer step it ended, Lightning's epoch and batch index); at the end rank 0 writes ``OUT_DIR/final.json`` with the loss on a fixed held-out batch. Scale
decisions go to ``OUT_DIR/decisions.jsonl``. ``--litdata DIR`` trains from a LitData stream instead (written
beforehand by :func:`write_stream`: the corpus's training windows in order), through LitData's ``StreamingDataLoader``. See docs/elastic.md for the two-terminal walk-through; the elastic
test and ``benchmarks/elastic.py`` run it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from examples.data import ByteCorpusDataModule
from examples.deepseek import DeepSeekMini
from lightning_ciuic import AsyncCheckpointer, HybridParallelStrategy
from lightning_ciuic.callbacks.elastic import ElasticResourceManager
from lightning_ciuic.callbacks.recovery import SnapshotRecovery

CORPUS = Path(__file__).resolve().parent / "data" / "kjv_pentateuch.txt"
TINY = dict(dim=32, n_layers=2, n_heads=2, kv_lora_rank=8, n_routed_experts=3, n_shared_experts=1,
            n_activated_experts=2, moe_inter_dim=16, dense_inter_dim=32, max_seq_len=32, lr=1e-2, weight_decay=0.0)


def fingerprint(window: torch.Tensor) -> str:
    """A training window's bytes, as hex: which sample of the corpus it is."""
    return bytes(window.to(torch.uint8).tolist()).hex()


class Progress(Callback):
    def __init__(self, path: Path, step_seconds: float) -> None:
        self.path, self.step_seconds, self._last, self._samples, self._step_before = path, step_seconds, -1, [], -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.step_seconds)
        self._samples += [fingerprint(window) for window in batch[0]]  # every batch of the step (accumulation)
        stepped = trainer.global_step > self._step_before  # this batch ended an optimizer step
        if trainer.global_step == self._last:
            return
        self._last = trainer.global_step
        record = {
            "time": time.time(), "step": trainer.global_step, "world": trainer.world_size, "rank": trainer.global_rank,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "accumulate": trainer.accumulate_grad_batches,
            "samples": self._samples if stepped else None,  # None: the first batch after a restart, mid-window
            "epoch": trainer.current_epoch, "batch": batch_idx,  # Lightning's position in the epoch
        }
        if stepped:
            self._samples = []
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")


def write_stream(path: Path, count: int) -> None:
    """The first ``count`` training windows of the corpus, in order, as a LitData dataset at ``path`` (``--litdata``)."""
    from litdata import optimize

    data = ByteCorpusDataModule(CORPUS, seq_len=32, batch_size=1)
    data.setup("fit")
    optimize(
        fn=functools.partial(_window, data.train_set), inputs=list(range(count)), output_dir=str(path),
        chunk_bytes="8KB", num_workers=1, mode="overwrite",
    )


def _window(dataset: torch.utils.data.Dataset, index: int) -> torch.Tensor:
    inputs, targets = dataset[index]
    return torch.cat([inputs, targets[-1:]])


class StreamedCorpus(ByteCorpusDataModule):
    """The corpus's held-out windows, and training windows streamed by LitData from ``stream`` (:func:`write_stream`)."""

    def __init__(self, stream: Path, batch_size: int) -> None:
        super().__init__(CORPUS, seq_len=32, batch_size=batch_size)
        self.stream = stream

    def train_dataloader(self):
        from litdata import StreamingDataLoader, StreamingDataset

        class Windows(StreamingDataset):
            def __getitem__(self, index):
                window = super().__getitem__(index)
                return window[:-1], window[1:]

        return StreamingDataLoader(Windows(str(self.stream)), batch_size=self.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--snapshot-freq", type=int, default=5)
    parser.add_argument(
        "--sharded", action="store_true",
        help="FSDP over every data-parallel rank (data_parallel_shard_size='auto'), with an AsyncCheckpointer every"
        " --snapshot-freq steps: a membership change resumes from its checkpoint, which DCP reshards",
    )
    parser.add_argument(
        "--experts", type=int, default=1, metavar="EP",
        help="with --sharded: the routed experts sharded EP ways over the data-parallel ranks (expert_parallel_size),"
        " 4 of them per layer; the expert layout is re-derived from each new world (EP must divide every world's dp)",
    )
    parser.add_argument("--batch-size", type=int, default=4, help="per-rank batch (global batch 8 kept by accumulation)")
    parser.add_argument("--litdata", type=Path, metavar="DIR", help="train from the LitData stream at DIR (write_stream)")
    args = parser.parse_args()
    if args.experts > 1 and not args.sharded:
        parser.error("--experts shards the experts of a --sharded run: add --sharded")
    args.out.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(1)
    seed_everything(0)
    callbacks = [
        Progress(args.out / "progress.jsonl", args.step_seconds),  # first: a step that ends in a preemption is recorded
        SnapshotRecovery(snapshot_freq=args.snapshot_freq, store="shm"),
        ElasticResourceManager(monitoring_interval=2.0, min_nodes=1, max_nodes=2, global_batch_size=8,
                               decisions_file=str(args.out / "decisions.jsonl")),
    ]
    strategy = "ciuic"
    if args.sharded:
        # timeout: a survivor blocked where no dead peer's socket closes (a store wait) fails within a minute and is
        # restarted, instead of the default half hour
        strategy = HybridParallelStrategy(data_parallel_shard_size="auto", expert_parallel_size=args.experts, timeout=60)
        callbacks.append(AsyncCheckpointer(str(args.out / "checkpoints"), every_n_train_steps=args.snapshot_freq, save_interval=None))
    trainer = Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), strategy=strategy, max_steps=args.steps,
        callbacks=callbacks, logger=False, enable_checkpointing=args.sharded, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )
    model = DeepSeekMini(**(TINY if args.experts == 1 else {**TINY, "n_routed_experts": 4}))
    data = ByteCorpusDataModule(CORPUS, seq_len=32, batch_size=args.batch_size)  # 4 on 2 ranks: accumulation 2 on one
    if args.litdata is not None:
        data = StreamedCorpus(args.litdata, args.batch_size)
    trainer.fit(model, data)
    held_out = next(iter(data.val_dataloader()))
    with torch.no_grad():  # every rank: a sharded model gathers its parameters for the forward
        loss = float(model.pipelined_loss(held_out))
    if trainer.global_rank == 0:
        (args.out / "final.json").write_text(json.dumps({"loss": loss, "world": trainer.world_size, "step": trainer.global_step}))


if __name__ == "__main__":
    main()
