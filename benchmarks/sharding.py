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

3. Slow link (``--parts link``; needs root, see benchmarks/sim_cluster.py): two simulated nodes joined by a
   ``--rate`` link (1 Gbit/s), one process each, dp_shard=2: Lightning's ``ModelParallelStrategy`` (FSDP2,
   uncompressed), ours uncompressed, and ours with int8 gradient reduce-scatter and int8 weight all-gather,
   alternating for ``--rounds`` rounds; step time as a ratio to the uncompressed runs of the same round. Target:
   int8 <= 0.6x. Then the loss: ours uncompressed and int8 for ``--loss-steps`` steps on loopback (the same seed
   and data order); the mean loss of the last 20 steps, int8 against uncompressed. Target: within 2%.

Parts 1 and 2 write the ``sharding`` section of docs/benchmarks.md, part 3 the ``sharding_link`` section.

    .venv/bin/python benchmarks/sharding.py [--steps 30] [--rounds 3] [--model large]
    sudo .venv/bin/python benchmarks/sharding.py --parts link [--rate 1gbit] [--steps 30] [--rounds 3] [--loss-steps 200]
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
from benchmarks.sim_cluster import SimulatedCluster, available, run_two_nodes  # noqa: E402
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


def fit(strategy, module, devices: int, steps: int, callbacks: list, num_nodes: int = 1) -> None:
    seed_everything(0)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, num_nodes=num_nodes, max_steps=steps, logger=False,
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


VARIANTS = {  # name: HybridParallelStrategy's compression arguments, or None for Lightning's ModelParallelStrategy
    "lightning": None,
    "ours": {},
    "ours-int8": dict(communication_compression="int8", weight_all_gather_compression="int8"),
}


def worker(name: str, model_name: str, steps: int, out: str, two_nodes: bool) -> None:
    """One timed run on 2 processes: Lightning's launcher starts the second by re-running this command, or
    (``two_nodes``) :func:`~benchmarks.sim_cluster.run_two_nodes` started one per node."""
    model, compression = MODELS[model_name], VARIANTS[name]
    if compression is not None:
        strategy = HybridParallelStrategy(data_parallel_size=2, data_parallel_shard_size=2, **compression)
        module = DeepSeekMini(**model)
    else:
        strategy, module = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), LightningFSDP(**model)
    fit(strategy, module, 1 if two_nodes else 2, steps, [StepTimer(out)], num_nodes=2 if two_nodes else 1)


def _worker_command(name: str, model_name: str, steps: int, out: Path, two_nodes: bool = False) -> list[str]:
    command = [sys.executable, __file__, "--worker", name, "--model", model_name, "--steps", str(steps), "--out", str(out)]
    return command + (["--two-nodes"] if two_nodes else [])


def slow_link(
    model_name: str, rate: str, steps: int, rounds: int, loss_steps: int, workdir: Path, command: str, label: str
) -> str:
    """Part 3 (see the module docstring): the markdown of the ``sharding_link`` section."""
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with SimulatedCluster(nodes=2, rate=rate) as cluster:
        for _ in range(rounds):
            for name in VARIANTS:
                out = workdir / f"link-{name}.json"
                run_two_nodes(_worker_command(name, model_name, steps, out, two_nodes=True), cluster)
                times[name].append(median_after_warmup(json.loads(out.read_text())["times"], WARMUP))
                print(f"{rate} {name}: {times[name][-1] * 1e3:.1f} ms", flush=True)
    losses = {}
    for name in ("ours", "ours-int8"):
        out = workdir / f"loss-{name}.json"
        run_two_nodes(_worker_command(name, model_name, loss_steps, out, two_nodes=True), None)
        losses[name] = statistics.mean(json.loads(out.read_text())["losses"][-20:])
        print(f"loss {name}: {losses[name]:.4f}", flush=True)
    rows = []
    for name in VARIANTS:
        ratios = [t / base for t, base in zip(times[name], times["ours"])]
        lightning = [t / base for t, base in zip(times[name], times["lightning"])]
        rows.append(
            f"| {name} | {statistics.median(times[name]) * 1e3:.0f} | **{statistics.median(ratios):.2f}**"
            f" ({', '.join(f'{r:.2f}' for r in ratios)}) | {statistics.median(lightning):.2f} |"
        )
    int8 = statistics.median(t / b for t, b in zip(times["ours-int8"], times["ours"]))
    drift = losses["ours-int8"] / losses["ours"] - 1
    return f"""## Sharded data parallelism on a slow link (int8 reduce-scatter and all-gather)

Command: `{command}`
({label}, 2 simulated nodes on a {rate} link, one CPU process each, 1 intra-op thread, gloo, dp_shard=2, batch 8 x 64
bytes per rank; median step time after {WARMUP} warm-up steps, {rounds} alternating rounds; ratios paired within a
round, the median in bold and each round's in brackets; machine: {machine()}). `ours-int8`: int8 gradient
reduce-scatter (qgZ, with error feedback) and int8 weight all-gather (qwZ). Target: int8 <= 0.6x of uncompressed.

| variant | ms/step (median) | step time / ours uncompressed: median (rounds) | step time / ModelParallelStrategy |
|---|---|---|---|
{chr(10).join(rows)}

int8 / uncompressed: **{int8:.2f}** ({'met' if int8 <= 0.6 else 'not met'}: target <= 0.6).
Loss, mean of the last 20 of {loss_steps} steps (loopback, same seed and data): uncompressed {losses['ours']:.4f},
int8 {losses['ours-int8']:.4f}: **{drift:+.1%}** ({'met' if abs(drift) <= 0.02 else 'not met'}: target within 2%).
"""


def step_times(model_name: str, steps: int, rounds: int, workdir: Path) -> tuple[list[float], list[float]]:
    ours, lightning = [], []
    for _ in range(rounds):
        for name, times in (("ours", ours), ("lightning", lightning)):
            out = workdir / f"time-{name}.json"
            command = _worker_command(name, model_name, steps, out)
            subprocess.run(command, check=True, cwd=workdir, stdout=subprocess.DEVNULL)
            times.append(median_after_warmup(json.loads(out.read_text())["times"], WARMUP))
            print(f"{name}: {times[-1] * 1e3:.1f} ms", flush=True)
    return ours, lightning


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="large", choices=sorted(MODELS))
    parser.add_argument("--parts", nargs="+", default=["memory", "time"], choices=["memory", "time", "link"])
    parser.add_argument("--rate", default="1gbit", help="part 3: the simulated link's rate (tc's syntax)")
    parser.add_argument("--loss-steps", type=int, default=200, help="part 3: steps of the loss comparison")
    parser.add_argument("--worker", choices=sorted(VARIANTS), help="internal: one timed run")
    parser.add_argument("--two-nodes", action="store_true", help="internal: the worker is one of two nodes")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.steps, args.out, args.two_nodes)
    model = MODELS[args.model]
    label = describe(DeepSeekMini(**model), args.model)
    command = " ".join([".venv/bin/python benchmarks/sharding.py", *sys.argv[1:]])
    sections = []
    if "link" in args.parts:
        reason = available()
        if reason:
            raise SystemExit(f"--parts link: {reason}")
        with tempfile.TemporaryDirectory() as tmp:
            write_section("sharding_link", slow_link(
                args.model, args.rate, args.steps, args.rounds, args.loss_steps, Path(tmp), command, label
            ))
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
    if sections:
        write_section("sharding", "## Sharded data parallelism (FSDP2 / HSDP)\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
