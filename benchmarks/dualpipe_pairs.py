"""DualPipeV's forward-backward pairs with their expert all-to-alls overlapped (parallel/paired_overlap.py), against the
same schedule with the all-to-alls blocking and with the two-chunk overlap alone, on simulated nodes.

The model: benchmarks/expert_dispatch.py's (the example DeepSeek-style decoder, 32 routed experts in 4 groups, each
token's 8 in its best 2 groups), ``--layers`` layers. The layout: pp 2 x dp 2, ep 2 over dp, DualPipeV with
``--microbatches`` micro-batches of ``--batch-size / --microbatches`` sequences of 64 tokens, flat dispatch, on 4
simulated nodes of one process each joined by ``--rate`` links (needs root, benchmarks/sim_cluster.py): the ep peers
(global ranks 0-1, 2-3) and the pipeline's neighbours sit on different nodes, so every all-to-all and every send
crosses a link. Variants, alternating (the order reversed every other round) for ``--rounds`` rounds of ``--steps``
steps:

* ``blocking``: ``expert_dispatch_overlap=False``; every all-to-all waited for where it is issued.
* ``chunks``: ``expert_dispatch_overlap=True`` with the pairs run one part after the other (the runner's
  ``overlap_pairs`` off): each micro-batch's tokens in two chunks, one's all-to-alls in flight while the other's
  experts compute.
* ``pairs``: ``expert_dispatch_overlap=True`` as the strategy runs it: in DualPipeV's forward-backward pairs each side's
  all-to-alls in flight while the other micro-batch computes, the two chunks elsewhere.

Per step, after ``WARMUP`` steps (rank mean): the expert all-to-alls' wall time (ep_comm) and the part the training
thread was blocked on them (ep_exposed), the CPU time of each rank's process, the step time (median). Ratios per round (median and spread) to ``blocking``
and ``pairs`` to ``chunks``. The same parameters in float64 are tests/integration/test_expert_parallel.py's.

Writes the ``dualpipe_pairs`` section of docs/benchmarks.md (``--dry-run``: prints it only).

    sudo .venv/bin/python benchmarks/dualpipe_pairs.py [--rate 1gbit] [--steps 12] [--rounds 3] [--batch-size 16]
        [--microbatches 8] [--layers 6]
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
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.common import StepTimer, machine, spread, write_section  # noqa: E402
from benchmarks.expert_dispatch import MOE, SEQUENCE  # noqa: E402
from benchmarks.sim_cluster import available, measured_rounds, node_benchmark_parser, run_measured  # noqa: E402

WARMUP = 3
NODES = 4  # one process each: pp 2 x dp 2
VARIANTS = ("blocking", "chunks", "pairs")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything

    from examples.data import ByteCorpusDataModule
    from examples.deepseek import DeepSeekMini
    from lightning_ciuic import HybridParallelStrategy
    from lightning_ciuic.parallel.paired_overlap import PAIR_STATS

    report: dict = {}

    class Measure(Callback):
        """The expert all-to-alls' seconds and the process's CPU seconds (all its threads) from the end of warm-up to
        the end of training, rank mean."""

        def on_train_start(self, trainer, pl_module):
            trainer.strategy.parallelized.pipeline.overlap_pairs = args.variant == "pairs"

        def _counters(self, trainer) -> tuple[float, float, float]:
            stats = trainer.strategy.parallelized.experts.stats
            return stats.seconds, stats.exposed_seconds, time.process_time()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == WARMUP:
                self.start = self._counters(trainer)

        def on_train_end(self, trainer, pl_module):
            steps = max(trainer.global_step - WARMUP, 1)
            mine = torch.tensor([e - s for e, s in zip(self._counters(trainer), self.start)], dtype=torch.float64)
            dist.all_reduce(mine)
            comm, exposed, cpu = (float(v) / steps / dist.get_world_size() for v in mine)
            report.update(ep_comm=comm, ep_exposed=exposed, cpu=cpu, pairs=PAIR_STATS["pairs"])

    seed_everything(0)
    torch.set_num_threads(1)
    strategy = HybridParallelStrategy(
        pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2, pipeline_schedule="dualpipev",
        num_microbatches=args.microbatches, expert_dispatch_overlap=args.variant != "blocking",
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, num_nodes=NODES, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[StepTimer(args.out), Measure()],
    )
    module = DeepSeekMini(**{**MOE, "n_layers": args.layers})
    trainer.fit(module, ByteCorpusDataModule(seq_len=SEQUENCE, batch_size=args.batch_size))
    if trainer.is_global_zero:
        Path(args.out + ".report").write_text(json.dumps(report))


def run(variant: str, args: argparse.Namespace, workdir: Path, cluster) -> dict:
    out = workdir / f"{variant}.json"
    argv = [sys.executable, __file__, "--worker", "--variant", variant, "--steps", str(args.steps), "--batch-size",
            str(args.batch_size), "--microbatches", str(args.microbatches), "--layers", str(args.layers), "--out", str(out)]
    return run_measured(argv, out, cluster, NODES, 1, WARMUP)


def measure(args: argparse.Namespace, workdir: Path) -> str:
    reason = available()
    if reason:
        return f"Not run: {reason}."
    results = measured_rounds(
        VARIANTS, args.rounds, NODES, args.rate, lambda variant, cluster: run(variant, args, workdir, cluster), "PAIRS",
        lambda r: f"{r['step']:.3f} s, ep_comm {r['ep_comm'] * 1e3:.0f} ms, ep_exposed {r['ep_exposed'] * 1e3:.0f} ms, pairs {r['pairs']}",
    )
    rows = []
    for variant in VARIANTS:
        runs = results[variant]
        to_blocking = [a["step"] / b["step"] for a, b in zip(runs, results["blocking"])]
        to_chunks = [a["step"] / b["step"] for a, b in zip(runs, results["chunks"])]
        hidden = [1 - r["ep_exposed"] / r["ep_comm"] if r["ep_comm"] else 0.0 for r in runs]
        rows.append(
            f"| {variant} | {statistics.median(r['step'] for r in runs):.3f} | {spread(to_blocking)} | {spread(to_chunks)} |"
            f" {statistics.median(r['ep_comm'] for r in runs) * 1e3:.0f} | {statistics.median(r['ep_exposed'] for r in runs) * 1e3:.0f} |"
            f" {statistics.median(hidden):.0%} | {statistics.median(r['cpu'] for r in runs):.3f} |"
        )
    return "\n".join([
        f"Four simulated nodes at {args.rate}, one process each (pp 2 x dp 2, ep 2 over dp, DualPipeV, flat dispatch),"
        f" {args.microbatches} micro-batches of {args.batch_size // args.microbatches} x {SEQUENCE} tokens per rank,"
        f" {args.steps} steps ({WARMUP} warm-up), {args.rounds} alternating rounds; step time (median), ratios per"
        " round; the expert all-to-alls' wall time per step (ep_comm: issue to completion) and the part the training"
        " thread was blocked on them (ep_exposed), rank mean; hidden = 1 - ep_exposed / ep_comm; CPU: the seconds a"
        " rank's process (all its threads) ran on a core per step, rank mean.",
        "",
        "| variant | step (s) | vs blocking | vs chunks | ep_comm (ms/step) | ep_exposed (ms/step) | hidden | CPU (s/step) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> None:
    parser = node_benchmark_parser("pairs", steps=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6, help="decoder layers (the first dense, the others experts)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        section = "\n".join([
            "## DualPipeV's forward-backward pairs, their all-to-alls overlapped",
            "",
            f"`sudo .venv/bin/python benchmarks/dualpipe_pairs.py --rate {args.rate} --steps {args.steps} --rounds"
            f" {args.rounds} --batch-size {args.batch_size} --microbatches {args.microbatches} --layers {args.layers}`"
            f" on {machine()}; model: benchmarks/expert_dispatch.py's with {args.layers} layers.",
            "",
            measure(args, Path(tmp)),
        ])
    print(section)
    if not args.dry_run:
        write_section("dualpipe_pairs", section)


if __name__ == "__main__":
    main()
