"""DynamicDataBalancer: two data-parallel ranks, one slowed 2x, with and without the balancer, side by side.

Runs (same model, data, seed; 2 CPU processes, 1 intra-op thread each, gloo, spawn), alternating for
``--rounds`` rounds so machine noise hits all alike:

* ``straggler``: rank 1 slowed by ``SlowRank(slowdown=2)`` (a sleep inside its compute), no balancer;
* ``straggler+throughput`` / ``straggler+gradient_aware``: the same with the balancer (``monitoring_freq``);
* ``even`` / ``even+balancer``: no straggler, without and with the balancer (its overhead; no rebalance wanted).

Reported: median step time over the steps after ``--settle`` (when the split has moved), throughput ratio
against the straggler run without the balancer (target >= 1.35, ideal 1.5), overhead without a straggler
(target <= 2%), and the loss trajectory: the global-batch loss of every step (each rank's mean loss weighted by
its samples), whose largest difference to the unbalanced run must be at fp32 rounding level.
Writes the ``data_balance`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/data_balance.py [--steps 60] [--settle 25] [--rounds 2]
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.utilities.data import extract_batch_size  # noqa: E402

from benchmarks.common import MODELS, describe, machine, write_section  # noqa: E402
from examples.data import ByteCorpusDataModule  # noqa: E402
from examples.deepseek import DeepSeekMini  # noqa: E402
from lightning_ciuic import DynamicDataBalancer, HybridParallelStrategy  # noqa: E402
from lightning_ciuic.testing import SlowRank  # noqa: E402

VARIANTS = {
    "straggler": (True, None),
    "straggler+throughput": (True, "throughput"),
    "straggler+gradient_aware": (True, "gradient_aware"),
    "even": (False, None),
    "even+balancer": (False, "gradient_aware"),
}


class GlobalLossAndTime(Callback):
    """Per step: wall time (rank 0) and the loss of the whole global batch (sample-weighted over ranks)."""

    def __init__(self, path: str) -> None:
        self.path, self.times, self.losses, self.splits, self._start = path, [], [], [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start, self._samples = time.perf_counter(), extract_batch_size(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        total = torch.tensor([float(outputs["loss"]) * self._samples, float(self._samples)], dtype=torch.float64)
        dist.all_reduce(total)
        self.losses.append(float(total[0] / total[1]))
        self.splits.append(self._samples)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"times": self.times, "losses": self.losses, "splits": self.splits}))


def run(variant: str, model_kwargs: dict, args: argparse.Namespace, out: Path) -> dict:
    straggler, rebalance = VARIANTS[variant]
    seed_everything(0)
    callbacks = [GlobalLossAndTime(str(out))]
    if rebalance is not None:
        callbacks.insert(0, DynamicDataBalancer(monitoring_freq=args.monitoring_freq, rebalance_strategy=rebalance))
    if straggler:
        callbacks.append(SlowRank(ranks=[1], slowdown=2.0))
    trainer = Trainer(
        strategy=HybridParallelStrategy(start_method="spawn"), accelerator="cpu", devices=2, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=callbacks,
    )
    trainer.fit(DeepSeekMini(**model_kwargs), ByteCorpusDataModule(seq_len=64, batch_size=args.batch))
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="example", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--settle", type=int, default=25)
    parser.add_argument("--monitoring-freq", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    medians = {v: [] for v in VARIANTS}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for variant in VARIANTS:
                results[variant] = run(variant, MODELS[args.model], args, Path(tmp) / f"{variant}.json")
                medians[variant].append(statistics.median(results[variant]["times"][args.settle :]))
                print(variant, f"{medians[variant][-1] * 1e3:.1f} ms/step", "rank-0 share", results[variant]["splits"][-1])
    def ratio(reference: str, variant: str) -> tuple[float, list[float]]:
        """Median over rounds of the paired (same round) throughput ratio variant / reference."""
        per_round = [r / v for r, v in zip(medians[reference], medians[variant])]
        return statistics.median(per_round), per_round

    rows = []
    for variant in VARIANTS:
        reference = "even" if variant.startswith("even") else "straggler"
        gain, per_round = ratio(reference, variant)
        losses = results[variant]["losses"]
        diff = max(abs(a - b) for a, b in zip(losses, results[reference]["losses"]))
        rows.append(
            f"| {variant} | {statistics.median(medians[variant]) * 1e3:.1f} | **{gain:.3f}**"
            f" ({', '.join(f'{x:.3f}' for x in per_round)}) | {results[variant]['splits'][-1]} of {2 * args.batch}"
            f" | {losses[-1]:.4f} | {diff:.1e} |"
        )
    gain_tp, gain_ga = ratio("straggler", "straggler+throughput")[0], ratio("straggler", "straggler+gradient_aware")[0]
    overhead = 1 / ratio("even", "even+balancer")[0] - 1
    even_split = results["even+balancer"]["splits"][-1]
    split = (
        f"the split stayed even ({even_split} of {2 * args.batch} on rank 0 at the end)" if even_split == args.batch
        else f"**the split moved** to {even_split} of {2 * args.batch} on rank 0 with no straggler"
    )
    slowdown = ratio("straggler", "even")[0]
    label = describe(DeepSeekMini(**MODELS[args.model]), args.model)
    write_section(
        "data_balance",
        f"""
## DynamicDataBalancer: one of two ranks slowed 2x

Command: `.venv/bin/python benchmarks/data_balance.py --model {args.model} --steps {args.steps} --settle {args.settle}
--monitoring-freq {args.monitoring_freq} --batch {args.batch} --rounds {args.rounds}` ({label}; HybridParallelStrategy dp=2,
2 CPU processes with 1 thread each, gloo; global batch {2 * args.batch} x 64 bytes; rank 1 slowed by
`SlowRank(slowdown=2)`, which made the whole step {slowdown:.2f}x slower than with no straggler; median step time
after step {args.settle}; {args.rounds} alternating rounds, ratios paired within a round, median over rounds
(per round in brackets); machine: {machine()}).

| run | ms/step (median of rounds) | throughput vs the same run without balancer | rank 0 share at the end | final global-batch loss | max loss difference to the run without balancer, over all steps |
|---|---|---|---|---|---|
{chr(10).join(rows)}

- With a straggler: **{gain_tp:.2f}x** throughput with `"throughput"`, **{gain_ga:.2f}x** with `"gradient_aware"`
  (target >= 1.35x; ideal 1.5x for a 2x straggler on 2 ranks).
- Without a straggler: overhead **{overhead * 100:+.1f}%** (target <= 2%); {split}.
- The loss trajectory is the same run's: the per-step global-batch loss differs from the unbalanced run's by at most
  the figure in the last column (fp32 summation order).
""",
    )


if __name__ == "__main__":
    main()
