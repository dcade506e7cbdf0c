"""Sharded data parallelism: memory per rank, and step time against Lightning's own FSDP2 strategy.

1. Memory (4 CPU processes, gloo, spawn): the same model trained for ``--steps`` steps as dp=4 replicas, HSDP
   (replicate 2 x shard 2) and FSDP (shard 4) under ``HybridParallelStrategy``. Each rank counts, at the end of
   training, the bytes of the parameters, gradients and AdamW state it holds (local shards), and its peak resident
   memory (``ru_maxrss``, the whole process: Python, torch, data and all). Target: the sharded parts <= 1/dp_shard
   + 10% of the replicated figure.
2. Step time (2 CPU processes): ``HybridParallelStrategy(data_parallel_shard_size=2)`` against Lightning's
   ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` with the same FSDP2 units applied in
   ``configure_model`` (each transformer block, then the root), alternating for ``--rounds`` rounds; the ratio is
   the median of the rounds' paired ratios of median step times. Target <= 1.05. ``ModelParallelStrategy`` only
   launches by re-running the script (as ``DDPStrategy(start_method="popen")``), so each run of either strategy is
   this script in ``--worker`` mode, both launched the same way.

Writes the ``sharding`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/sharding.py [--steps 30] [--rounds 3] [--model large]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # the same intra-op threads for both strategies

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from benchmarks.common import MODELS, StepTimer, describe, machine, median_after_warmup, write_section  # noqa: E402
from examples.data import ByteCorpusDataModule  # noqa: E402
from examples.deepseek import DeepSeekMini  # noqa: E402
from lightning_ciuic import HybridParallelStrategy  # noqa: E402
from lightning_ciuic.tensors import local_tensor  # noqa: E402

WARMUP = 5
MB = 2**20


class HeldBytes(Callback):
    """Rank 0 writes the bytes of parameters, gradients and optimizer state it holds, and its peak RSS."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def on_train_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        params = list(pl_module.parameters())
        state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim() > 0]

        def size(tensors):
            return sum(local_tensor(t).numel() * t.element_size() for t in tensors if t is not None)

        held = {
            "params": size(params), "grads": size([p.grad for p in params]), "optimizer": size(state),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        Path(self.path).write_text(json.dumps(held))


class LightningFSDP(DeepSeekMini):
    """The same model for Lightning's ModelParallelStrategy: FSDP2 units applied by the module, as Lightning asks."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh, reshard_after_forward=False)


def fit(strategy, module, devices: int, steps: int, callbacks: list) -> None:
    seed_everything(0)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(module, ByteCorpusDataModule(seq_len=64, batch_size=8))


def memory(model: dict, steps: int, workdir: Path) -> dict[int, dict]:
    rows = {}
    for shard in (1, 2, 4):
        out = workdir / f"memory-{shard}.json"
        strategy = HybridParallelStrategy(data_parallel_size=4, data_parallel_shard_size=shard, start_method="spawn")
        fit(strategy, DeepSeekMini(**model), 4, steps, [HeldBytes(out)])
        rows[shard] = json.loads(out.read_text())
        print(f"shard {shard}: {rows[shard]}", flush=True)
    return rows


def worker(name: str, model_name: str, steps: int, out: str) -> None:
    """One timed run on 2 processes (Lightning's launcher starts the second by re-running this command)."""
    model = MODELS[model_name]
    if name == "ours":
        strategy, module = HybridParallelStrategy(data_parallel_size=2, data_parallel_shard_size=2), DeepSeekMini(**model)
    else:
        strategy, module = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), LightningFSDP(**model)
    fit(strategy, module, 2, steps, [StepTimer(out)])


def step_times(model_name: str, steps: int, rounds: int, workdir: Path) -> tuple[list[float], list[float]]:
    ours, lightning = [], []
    for _ in range(rounds):
        for name, times in (("ours", ours), ("lightning", lightning)):
            out = workdir / f"time-{name}.json"
            command = [sys.executable, __file__, "--worker", name, "--model", model_name, "--steps", str(steps), "--out", str(out)]
            subprocess.run(command, check=True, cwd=workdir, stdout=subprocess.DEVNULL)
            times.append(median_after_warmup(json.loads(out.read_text())["times"], WARMUP))
            print(f"{name}: {times[-1] * 1e3:.1f} ms", flush=True)
    return ours, lightning


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="large", choices=sorted(MODELS))
    parser.add_argument("--parts", nargs="+", default=["memory", "time"], choices=["memory", "time"])
    parser.add_argument("--worker", choices=["ours", "lightning"], help="internal: one timed run")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.steps, args.out)
    model = MODELS[args.model]
    label = describe(DeepSeekMini(**model), args.model)
    command = " ".join([".venv/bin/python benchmarks/sharding.py", *sys.argv[1:]])
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        if "memory" in args.parts:
            rows = memory(model, args.steps, Path(tmp))
            base = rows[1]
            lines = []
            for shard, row in rows.items():
                states = row["params"] + row["grads"] + row["optimizer"]
                share = states / (base["params"] + base["grads"] + base["optimizer"])
                target = "" if shard == 1 else f" (target <= {1 / shard + 0.10:.2f}: {'met' if share <= 1 / shard + 0.10 else 'not met'})"
                layout = {1: "replicated (dp=4)", 2: "HSDP (replicate 2 x shard 2)", 4: "FSDP (shard 4)"}[shard]
                lines.append(
                    f"| {layout} | {row['params'] / MB:.1f} | {row['grads'] / MB:.1f} | {row['optimizer'] / MB:.1f} |"
                    f" **{share:.3f}**{target} | {row['peak_rss'] / MB:.0f} ({row['peak_rss'] / base['peak_rss']:.2f}) |"
                )
            sections.append(
                f"""
### Memory per rank

Command: `{command}`
({label}, AdamW, 4 CPU processes, gloo; rank 0's local shards at the end of training; peak RSS is the whole
process: Python, torch, the data and the gathered blocks; machine: {machine()}). The sharded parts shrink as
1/dp_shard; peak RSS does not: at this size the process's own ~0.5 GB dominates, each worker receives the whole
model before sharding it, and FSDP2's gather and reduce-scatter buffers come on top.

| layout | parameters MB | gradients MB | optimizer MB | sharded parts vs replicated | peak RSS MB (vs replicated) |
|---|---|---|---|---|---|
"""
                + "\n".join(lines)
            )
        if "time" in args.parts:
            ours, lightning = step_times(args.model, args.steps, args.rounds, Path(tmp))
            ratios = [o / l for o, l in zip(ours, lightning)]
            ratio = statistics.median(ratios)
            sections.append(
                f"""
### Step time against Lightning's `ModelParallelStrategy` (FSDP2, dp_shard=2)

Command: `{command}`
({label}, 2 CPU processes, 1 intra-op thread each, gloo; the same FSDP2 units (each block, then the root); median
step time after {WARMUP} warm-up steps, {args.rounds} alternating rounds; the ratio is the median of the paired
ratios). Target: <= 1.05.

| ModelParallelStrategy ms/step | HybridParallelStrategy ms/step | ratio ours / Lightning | per round |
|---|---|---|---|
| {statistics.median(lightning) * 1e3:.1f} | {statistics.median(ours) * 1e3:.1f} | **{ratio:.3f}** ({'met' if ratio <= 1.05 else 'not met'}) | {', '.join(f'{r:.3f}' for r in ratios)} |
"""
            )
    write_section("sharding", "## Sharded data parallelism (FSDP2 / HSDP)\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
