"""HybridParallelStrategy's uncompressed data parallel against Lightning's DDPStrategy, side by side.

Same model, data, seed and process launch (multiprocessing spawn, 2 CPU processes, gloo); the two
strategies alternate for ``--rounds`` rounds so machine noise hits both alike. Reported: median step time
after warm-up, and the ratio ours / DDP (target <= 1.10). Writes the ``strategy_vs_ddp`` section of
docs/benchmarks.md.

    .venv/bin/python benchmarks/strategy_vs_ddp.py [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Same intra-op threads for both strategies (ours would otherwise pick cores / processes, DDP all cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from benchmarks.common import MODELS, StepTimer, describe, machine, median_after_warmup, write_section  # noqa: E402
from examples.data import ByteCorpusDataModule  # noqa: E402
from examples.deepseek import DeepSeekMini  # noqa: E402
from lightning_ciuic import HybridParallelStrategy  # noqa: E402

WARMUP = 5


def run_once(strategy_name: str, model_kwargs: dict, steps: int, workdir: Path) -> dict:
    seed_everything(0)
    strategy = (
        DDPStrategy(start_method="spawn")
        if strategy_name == "DDPStrategy"
        else HybridParallelStrategy(start_method="spawn")
    )
    out = workdir / f"{strategy_name}.json"
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[StepTimer(out)],
    )
    trainer.fit(DeepSeekMini(**model_kwargs), ByteCorpusDataModule(seq_len=64, batch_size=16))
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("example", "medium"):
            kwargs = MODELS[name]
            label = describe(DeepSeekMini(**kwargs), name)
            medians = {"DDPStrategy": [], "HybridParallelStrategy": []}
            for _ in range(args.rounds):
                for name in medians:
                    result = run_once(name, kwargs, args.steps, Path(tmp))
                    medians[name].append(median_after_warmup(result["times"], WARMUP))
            ddp, ours = statistics.median(medians["DDPStrategy"]), statistics.median(medians["HybridParallelStrategy"])
            ratios = [o / d for o, d in zip(medians["HybridParallelStrategy"], medians["DDPStrategy"])]
            ratio = statistics.median(ratios)  # paired within a round: the machine's drift hits both alike
            rows.append((label, ddp, ours, ratio, ratios))
            print(f"{label}: DDP {ddp * 1e3:.1f} ms, ours {ours * 1e3:.1f} ms, ratio {ratio:.3f} (per round {ratios})")
    table = "\n".join(
        f"| {label} | {ddp * 1e3:.1f} | {ours * 1e3:.1f} | **{ratio:.3f}** | {', '.join(f'{r:.3f}' for r in rounds)} |"
        for label, ddp, ours, ratio, rounds in rows
    )
    write_section(
        "strategy_vs_ddp",
        f"""
## HybridParallelStrategy (uncompressed dp=2) vs Lightning `DDPStrategy`

Command: `.venv/bin/python benchmarks/strategy_vs_ddp.py --steps {args.steps} --rounds {args.rounds}`
(2 CPU processes, 1 intra-op thread each, gloo, spawn; batch 16 x 64 bytes per rank; median step time after {WARMUP} warm-up steps,
medians of {args.rounds} alternating rounds, the ratio the median of the rounds' paired ratios; machine: {machine()}). Target: ratio <= 1.10.

| model | DDPStrategy ms/step | HybridParallelStrategy ms/step | ratio ours/DDP | ratio per round |
|---|---|---|---|---|
{table}
""",
    )


if __name__ == "__main__":
    main()
