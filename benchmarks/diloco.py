"""DiLoCo against DDPStrategy on a simulated slow link, side by side.

1. Speed (needs root: benchmarks/sim_cluster.py): two simulated nodes joined by a ``--rate`` link, one process each,
   the "large" model (8.6M parameters), batch ``--speed-batch`` x 64 bytes per rank (4: where the link, not the
   compute, sets DDP's pace). Variants: Lightning's ``DDPStrategy``,
   ``DiLoCo(sync_every=H)``, ``DiLoCo(sync_every=H, compression="int8")``, Streaming DiLoCo's
   ``fragments=4`` and ``fragments=4, overlap_steps=2``, alternating for ``--rounds`` rounds.
   Step time is the *mean* after warm-up (a sync step is slower than the others: the mean charges it), as a ratio
   to DDP's in the same round; bytes this rank sent per step from each strategy's counters (DDP: the ring formula),
   on average and at the peak (the most any one step sent: fragments spread a sync's bytes over the round).
2. Loss (loopback): the example model for ``--loss-steps`` steps, DDP and ``DiLoCo(sync_every=H)``, same seed and
   data (equal tokens): mean training loss of the last 20 steps, DiLoCo against DDP.

Writes the ``diloco`` section of docs/benchmarks.md.

    sudo .venv/bin/python benchmarks/diloco.py [--rate 1gbit] [--sync-every 16] [--steps 48] [--speed-batch 4]
        [--rounds 2] [--loss-steps 300]
    .venv/bin/python benchmarks/diloco.py --loss-only "DiLoCo sync_every=16 outer_lr=1.0" ...   (loss sweep, prints)
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
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.common import MODELS, StepTimer, describe, machine, write_section  # noqa: E402
from benchmarks.sim_cluster import SimulatedCluster, available, run_two_nodes  # noqa: E402

WARMUP = 5


def _strategy(variant: str, sync_every: int):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ciuic import DiLoCo, HybridParallelStrategy

    if variant == "DDPStrategy":
        return DDPStrategy()
    # "DiLoCo sync_every=16 int8 outer_lr=1.0": DiLoCo's arguments as name=value words ("int8": the compression)
    settings = dict(word.split("=") for word in variant.split()[1:] if "=" in word)
    return HybridParallelStrategy(diloco=DiLoCo(
        sync_every=int(settings.get("sync_every", sync_every)), compression="int8" if variant.endswith("int8") else "none",
        outer_lr=float(settings.get("outer_lr", 0.7)), outer_momentum=float(settings.get("outer_momentum", 0.9)),
        fragments=int(settings.get("fragments", 1)), overlap_steps=int(settings.get("overlap_steps", 0)),
    ))


def worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from examples.data import ByteCorpusDataModule
    from examples.deepseek import DeepSeekMini

    class Sent(Callback):
        """Bytes this rank sent: in all, and the most in one step (DDP: the ring formula, the same every step)."""

        def __init__(self) -> None:
            self.before, self.peak = 0, 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = getattr(trainer.strategy, "data_parallel", None)
            if engine is not None:
                self.peak, self.before = max(self.peak, engine.stats.bytes_sent - self.before), engine.stats.bytes_sent

        def on_train_end(self, trainer, pl_module):
            engine = getattr(trainer.strategy, "data_parallel", None)
            numel = sum(p.numel() for p in pl_module.parameters())
            sent = engine.stats.bytes_sent if engine is not None else 4 * numel * trainer.global_step  # ring, 2 ranks
            peak = self.peak if engine is not None else 4 * numel
            if trainer.is_global_zero:
                Path(args.out + ".bytes").write_text(
                    json.dumps({"bytes": sent, "peak": peak, "steps": trainer.global_step, "params": numel})
                )

    seed_everything(0)
    torch.set_num_threads(1)
    trainer = Trainer(
        strategy=_strategy(args.variant, args.sync_every), accelerator="cpu", devices=1, num_nodes=2,
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[StepTimer(args.out), Sent()],
    )
    trainer.fit(DeepSeekMini(**MODELS[args.model]), ByteCorpusDataModule(seq_len=64, batch_size=args.batch_size))


def run(variant: str, model: str, steps: int, batch: int, sync_every: int, workdir: Path, cluster) -> dict:
    out = workdir / f"{variant.replace(' ', '_')}-{model}-{steps}.json"
    argv = [sys.executable, __file__, "--worker", "--variant", variant, "--model", model, "--steps", str(steps),
            "--batch-size", str(batch), "--sync-every", str(sync_every), "--out", str(out)]
    run_two_nodes(argv, cluster)
    return {**json.loads(out.read_text()), **json.loads(Path(str(out) + ".bytes").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--speed-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loss-steps", type=int, default=300, help="0: no loss comparison")
    parser.add_argument("--section", default="diloco", help="the docs/benchmarks.md section written")
    parser.add_argument(
        "--loss-only", nargs="*", default=None,
        help="only the loss part, for these DiLoCo variants (e.g. 'DiLoCo sync_every=16 outer_lr=1.0'); prints, writes nothing",
    )
    parser.add_argument("--worker", action="store_true", help="internal: one rank of one run")
    parser.add_argument("--variant", default="DDPStrategy")
    parser.add_argument("--model", default="large")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    h = args.sync_every
    if args.loss_only is not None:  # a sweep of the loss at equal tokens against DDP, on loopback
        with tempfile.TemporaryDirectory() as tmp:
            for variant in ["DDPStrategy", *args.loss_only]:
                loss = statistics.fmean(run(variant, "example", args.loss_steps, 16, h, Path(tmp), None)["losses"][-20:])
                print(f"LOSS {variant}: {loss:.4f}", flush=True)
        return
    reason = available()
    if reason:
        raise SystemExit(f"benchmarks/diloco.py: {reason}")
    variants = [
        "DDPStrategy", f"DiLoCo sync_every={h}", f"DiLoCo sync_every={h} int8", f"DiLoCo sync_every={h} fragments=4",
        f"DiLoCo sync_every={h} fragments=4 overlap_steps=2",
    ]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp, SimulatedCluster(nodes=2, rate=args.rate) as cluster:
        for _ in range(args.rounds):
            for variant in variants:
                results[variant].append(run(variant, "large", args.steps, args.speed_batch, h, Path(tmp), cluster))
                print(variant, statistics.fmean(results[variant][-1]["times"][WARMUP:]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        losses = {v: run(v, "example", args.loss_steps, 16, h, Path(tmp), None)["losses"] for v in variants[:2]} if args.loss_steps else {}
    ddp = [statistics.fmean(r["times"][WARMUP:]) for r in results["DDPStrategy"]]
    ddp_bytes = results["DDPStrategy"][-1]["bytes"] / results["DDPStrategy"][-1]["steps"]
    rows = []
    for variant in variants:
        means = [statistics.fmean(r["times"][WARMUP:]) for r in results[variant]]
        ratios = [m / d for m, d in zip(means, ddp)]
        per_step = results[variant][-1]["bytes"] / results[variant][-1]["steps"]
        peak = results[variant][-1]["peak"]
        rows.append(
            f"| {variant} | {statistics.median(means) * 1e3:.0f} | **{statistics.median(ratios):.2f}**"
            f" ({', '.join(f'{r:.2f}' for r in ratios)}) | {per_step / 1e6:.2f} ({per_step / ddp_bytes:.3f}) |"
            f" {peak / 1e6:.2f} ({peak / ddp_bytes:.2f}) |"
        )
    loss_line = ""
    if losses:
        ddp_loss, diloco_loss = (statistics.fmean(losses[v][-20:]) for v in variants[:2])
        loss_line = f"""Loss at equal tokens (the example model, batch 16 x 64 bytes per rank, {args.loss_steps} steps on loopback, same seed
and data; mean of the last 20 steps): DDP {ddp_loss:.4f}, DiLoCo sync_every={h} {diloco_loss:.4f}: **{diloco_loss / ddp_loss - 1:+.1%}**."""
    command = " ".join(["sudo .venv/bin/python benchmarks/diloco.py", *sys.argv[1:]])
    write_section(args.section, f"""## DiLoCo on a {args.rate} link

Command: `{command}` ({describe_large()}, 2 simulated nodes on a {args.rate} link, one CPU process each, batch
{args.speed_batch} x 64 bytes per rank, {args.steps} steps; mean step time after {WARMUP} warm-up steps (sync steps included), ratio to
`DDPStrategy` in the same round, {args.rounds} alternating rounds, the median in bold and each round's in brackets;
machine: {machine()}). Targets (issue): step time <= 0.40x DDP's, bytes <= 1/sync_every of DDP's. Peak: the most
bytes one step sent (an overlapped sync's are counted at the step it lands, its traffic spread over the steps between).

| variant | ms/step (mean) | step time / DDPStrategy: median (rounds) | MB sent per step per rank (share of DDP's) | peak MB in one step (share of DDP's step) |
|---|---|---|---|---|
""" + "\n".join(rows) + f"""

{loss_line}
""")


def describe_large() -> str:
    from examples.deepseek import DeepSeekMini

    return describe(DeepSeekMini(**MODELS["large"]), "large")


if __name__ == "__main__":
    main()
