"""Pipeline parallelism: measured bubble against theory, schedules and layouts side by side.

Two sections of docs/benchmarks.md, one run:

* bubble: pp=2 on 2 CPU processes, a balanced model (DeepSeekMini with dense layers only), GPipe and 1F1B
  at several micro-batch counts, then every other schedule at 4 micro-batches. Each rank measures the
  fraction of the step it did not compute (``pipeline/bubble``, the strategy's own measurement); reported
  as the mean over both ranks and the measured steps, next to (p - 1) / (m + p - 1).
* layouts: the same model and global batch trained with dp=2, tp=2, pp=2 without micro-batches (naive
  model parallelism: one stage works at a time) and pp=2 with 1F1B at 4 and 8 micro-batches (with and
  without activation checkpointing); throughput relative to naive model parallelism, the comparison in
  which the seed's "2.3x" from pipelining can be read.

    .venv/bin/python benchmarks/pipeline.py [--steps 16] [--rounds 1] [--batch 16]

``--batch`` is the global batch (samples of 64 bytes): at 16, 8 micro-batches hold 2 samples each and
their fixed costs show; the section names carry the batch so runs at several sizes sit side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per process, like every layout here

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

from benchmarks.common import describe, machine, write_section  # noqa: E402
from examples.data import ByteCorpusDataModule  # noqa: E402
from examples.deepseek import DeepSeekMini  # noqa: E402
from lightning_ciuic import HybridParallelStrategy  # noqa: E402
from lightning_ciuic.parallel.pipeline import theoretical_bubble  # noqa: E402

WARMUP = 4
SEQ = 64
BALANCED = dict(dim=256, n_layers=8, n_dense_layers=8, dense_inter_dim=768, kv_lora_rank=64, max_seq_len=SEQ)


class Probe(Callback):
    """Each rank writes its step times and, under pipeline parallelism, its measured bubble per step."""

    def __init__(self, directory: str) -> None:
        self.directory, self.times, self.bubbles, self._start = directory, [], [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is not None:
            self.bubbles.append(pipeline.bubble)

    def on_train_end(self, trainer, pl_module):
        path = Path(self.directory) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"times": self.times, "bubbles": self.bubbles}))


def run(strategy_kwargs: dict, steps: int, batch: int, workdir: Path) -> dict:
    """One training run on 2 processes; returns median step time and mean bubble over ranks (after warm-up)."""
    for old in workdir.glob("rank*.json"):
        old.unlink()
    seed_everything(0)
    dp = strategy_kwargs.get("data_parallel_size", 1)
    trainer = Trainer(
        strategy=HybridParallelStrategy(start_method="spawn", **strategy_kwargs), accelerator="cpu", devices=2,
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[Probe(str(workdir))],
    )
    trainer.fit(DeepSeekMini(**BALANCED), ByteCorpusDataModule(seq_len=SEQ, batch_size=batch // dp))
    ranks = [json.loads(p.read_text()) for p in sorted(workdir.glob("rank*.json"))]
    step = statistics.median(max(r["times"][i] for r in ranks) for i in range(WARMUP, steps))
    bubbles = [statistics.mean(r["bubbles"][WARMUP:]) for r in ranks if r["bubbles"]]
    return {"step": step, "bubble": statistics.mean(bubbles) if bubbles else None, "per_rank": bubbles}


def pp2(schedule: str, m: int, **extra) -> dict:
    return dict(pipeline_parallel_size=2, data_parallel_size=1, pipeline_schedule=schedule, num_microbatches=m, **extra)


BUBBLE_RUNS = [
    *(("gpipe", m, {}) for m in (1, 2, 4, 8)),
    *(("1f1b", m, {}) for m in (2, 4, 8)),
    ("interleaved_1f1b", 4, {"stages_per_rank": 2}),
    ("looped_bfs", 4, {"stages_per_rank": 2}),
    ("interleaved_zero_bubble", 4, {"stages_per_rank": 2}),
    ("zbv_zero_bubble", 4, {}),
    ("dualpipev", 4, {}),
]
LAYOUTS = [
    ("dp=2", dict(data_parallel_size=2)),
    ("tp=2", dict(data_parallel_size=1, tensor_parallel_size=2)),
    ("pp=2, 1 micro-batch (naive model parallel)", pp2("gpipe", 1)),
    ("pp=2, 1F1B, 4 micro-batches", pp2("1f1b", 4)),
    ("pp=2, 1F1B, 8 micro-batches", pp2("1f1b", 8)),
    ("pp=2, 1F1B, 4 micro-batches, activation checkpointing", pp2("1f1b", 4, gradient_checkpointing=True)),
]


def best(results: list[dict]) -> dict:
    return min(results, key=lambda r: r["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16, help="global batch, in samples")
    parser.add_argument("--bubble-only", action="store_true", help="GPipe and 1F1B rows only, no layouts")
    args = parser.parse_args()
    label = describe(DeepSeekMini(**BALANCED), "balanced DeepSeekMini, 8 dense layers")
    bubble_rows, layout_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for schedule, m, extra in BUBBLE_RUNS:
            if args.bubble_only and schedule not in ("gpipe", "1f1b"):
                continue
            result = best([run(pp2(schedule, m, **extra), args.steps, args.batch, workdir) for _ in range(args.rounds)])
            theory = theoretical_bubble(2, m) if schedule in ("gpipe", "1f1b") else None
            bubble_rows.append((schedule, m, result, theory))
            print(schedule, m, result, theory, flush=True)
        for name, kwargs in [] if args.bubble_only else LAYOUTS:
            result = best([run(kwargs, args.steps, args.batch, workdir) for _ in range(args.rounds)])
            layout_rows.append((name, result))
            print(name, result, flush=True)
    bubble_table = "\n".join(
        f"| {schedule} | {m} | {r['bubble']:.3f} ({', '.join(f'{b:.3f}' for b in r['per_rank'])}) | "
        + (f"{theory:.3f} | **{r['bubble'] / theory:.2f}** |" if theory else "(see text) | |")
        + f" {r['step'] * 1e3:.0f} |"
        for schedule, m, r, theory in bubble_rows
    )
    command = (
        f"`.venv/bin/python benchmarks/pipeline.py --steps {args.steps} --rounds {args.rounds} --batch {args.batch}"
        + (" --bubble-only`" if args.bubble_only else "`")
    )
    setup = (
        f"{label}, global batch {args.batch} x {SEQ} bytes, 2 CPU processes with 1 intra-op thread each, gloo;"
        f" median over steps {WARMUP + 1}-{args.steps} of the slowest rank's step time, best of {args.rounds}"
        f" round(s); machine: {machine()}"
    )
    write_section(
        f"pipeline_bubble_batch{args.batch}",
        f"""
## Pipeline bubble at a global batch of {args.batch}: measured against (p - 1) / (m + p - 1)

Command: {command} ({setup}). The bubble is the strategy's own measurement, logged as `pipeline/bubble`:
the fraction of each step a rank spent outside its stages' forward and backward computation, i.e. waiting
for its neighbour (and for the activations and gradients to travel). Mean over both ranks (per rank in
brackets). Target: within 25% of theory for GPipe and 1F1B on a balanced model (ratio 0.75-1.25).

| schedule | micro-batches | measured bubble | theory | measured / theory | ms/step |
|---|---|---|---|---|---|
{bubble_table}

Interleaved, looped and zero-bubble schedules have no single closed form here (their idle time depends
on the split of backward into input and weight gradients); where measured, it is at 4 micro-batches with
2 virtual stages per rank (V-shaped for ZBV and DualPipeV) for comparison with 1F1B's row above.
""",
    )
    if args.bubble_only:
        return
    naive = layout_rows[2][1]["step"]
    layout_table = "\n".join(
        f"| {name} | {r['step'] * 1e3:.0f} | **{naive / r['step']:.2f}** | "
        + (f"{r['bubble']:.3f}" if r["bubble"] is not None else "-")
        + " |"
        for name, r in layout_rows
    )
    write_section(
        "pipeline_layouts",
        f"""
## Pipeline layouts side by side, and the seed's "2.3x"

Command: {command} ({setup}). Throughput is relative to pp=2 with a single micro-batch, i.e. naive
model parallelism, where only one stage computes at a time.

| layout | ms/step | throughput vs naive model parallel | bubble |
|---|---|---|---|
{layout_table}
""",
    )


if __name__ == "__main__":
    main()
