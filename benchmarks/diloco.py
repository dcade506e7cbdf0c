"""DiLoCo against DDPStrategy on a simulated slow link, side by side.

1. Speed (needs root: benchmarks/sim_cluster.py): two simulated nodes joined by a ``--rate`` link, one process each,
   the "large" model (8.6M parameters; ``--speed-model mlp``: an 8M-parameter MLP, ``benchmarks.common.ByteMLP``), batch ``--speed-batch`` x 64 bytes per rank (4: where the link, not the
   compute, sets DDP's pace). Variants: Lightning's ``DDPStrategy``,
   ``DiLoCo(sync_every=H)``, ``DiLoCo(sync_every=H, compression="int8")``, Streaming DiLoCo's
   ``fragments=4`` and ``fragments=4, overlap_steps=2``, and ``sync_every=NO_SYNC`` (no sync inside the run: the
   same processes' compute alone, the floor of every DiLoCo variant), alternating for ``--rounds`` rounds.
   Step time is the *mean* after warm-up (a sync step is slower than the others: the mean charges it), as a ratio
   to DDP's in the same round; bytes this rank sent per step from each strategy's counters (DDP: the ring formula),
   on average and at the peak (the most any one step sent: fragments spread a sync's bytes over the round).
2. Loss (loopback): the example model for ``--loss-steps`` steps, DDP and ``DiLoCo(sync_every=H)``, same seed and
   data (equal tokens): the validation loss after training (the whole held-out split, DiLoCo's final sync done) and
   the mean training loss of the last 20 steps, DiLoCo against DDP.

Writes the ``diloco`` section of docs/benchmarks.md.

    sudo .venv/bin/python benchmarks/diloco.py [--rate 1gbit] [--sync-every 16] [--steps 48] [--speed-batch 4]
        [--rounds 2] [--loss-steps 300]
    .venv/bin/python benchmarks/diloco.py --loss-only "DiLoCo sync_every=16 outer_lr=1.0" ... --section diloco_loss
        (loss sweep: DDP and each variant, one run each)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.common import StepTimer, benchmark_model, describe, machine, write_section  # noqa: E402
from benchmarks.sim_cluster import SimulatedCluster, available, run_two_nodes  # noqa: E402

WARMUP = 5
NO_SYNC = 1_000_000  # a round longer than any run: no outer sync inside the timed steps (the last runs after them)


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
    module, data = benchmark_model(args.model), ByteCorpusDataModule(seq_len=64, batch_size=args.batch_size)
    trainer.fit(module, data)
    if args.validate and trainer.is_global_zero:  # after fit: DiLoCo's final sync has made the replicas equal
        Path(args.out + ".val").write_text(json.dumps({"val_loss": validation_loss(module, data)}))


def validation_loss(module, data) -> float:
    """Mean cross-entropy of ``module`` over the whole held-out split (every window, token-weighted)."""
    import torch

    module.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in data.val_dataloader():
            total += float(module.pipeline_loss(module(inputs), targets)) * targets.numel()
            tokens += targets.numel()
    return total / tokens


def run(variant: str, model: str, steps: int, batch: int, sync_every: int, workdir: Path, cluster, validate: bool = False) -> dict:
    out = workdir / f"{variant.replace(' ', '_')}-{model}-{steps}.json"
    argv = [sys.executable, __file__, "--worker", "--variant", variant, "--model", model, "--steps", str(steps),
            "--batch-size", str(batch), "--sync-every", str(sync_every), "--out", str(out)] + ["--validate"] * validate
    run_two_nodes(argv, cluster)
    result = {**json.loads(out.read_text()), **json.loads(Path(str(out) + ".bytes").read_text())}
    return {**result, **json.loads(Path(str(out) + ".val").read_text())} if validate else result


def loss_at_equal_tokens(variant: str, steps: int, sync_every: int, workdir: Path) -> tuple[float, float]:
    """(mean training loss of the last 20 steps, validation loss after training) of the example model on loopback."""
    result = run(variant, "example", steps, 16, sync_every, workdir, None, validate=True)
    return statistics.fmean(result["losses"][-20:]), result["val_loss"]


def loss_sweep(variants: list[str], steps: int, sync_every: int, section: str) -> None:
    """DDP and each DiLoCo variant for ``steps`` steps on loopback, same seed and data; writes ``section``."""
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ["DDPStrategy", *variants]:
            losses[variant] = loss_at_equal_tokens(variant, steps, sync_every, Path(tmp))
            print(f"LOSS {variant}: train {losses[variant][0]:.4f} validation {losses[variant][1]:.4f}", flush=True)
    ddp_train, ddp_val = losses["DDPStrategy"]
    rows = [
        f"| {variant} | {val:.4f} | **{val / ddp_val - 1:+.1%}** | {train:.4f} | {train / ddp_train - 1:+.1%} |"
        for variant, (train, val) in losses.items()
    ]
    command = shlex.join([".venv/bin/python", "benchmarks/diloco.py", *sys.argv[1:]])
    write_section(section, f"""## DiLoCo's loss at equal tokens

Command: `{command}` (the {describe(benchmark_model("example"), "example")} model, 2 ranks on loopback, batch 16 x 64
bytes per rank, {steps} steps, same seed and data for every variant, AdamW inner optimizer at the model's lr; one
run each; machine: {machine()}). Validation loss: the whole held-out split after training (DiLoCo's final sync
done); training loss: the mean of the last 20 steps. Target (issue): validation loss within 3% of DDP's.
Variants name DiLoCo's arguments (`int8`: compressed outer gradients); unnamed ones are the defaults
(`sync_every` {sync_every}, `outer_lr` 0.7, `outer_momentum` 0.9).

| variant | validation loss | against DDP | training loss | against DDP |
|---|---|---|---|---|
""" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--speed-batch", type=int, default=4)
    parser.add_argument("--speed-model", default="large", choices=["large", "mlp"], help="the model of the speed part")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loss-steps", type=int, default=300, help="0: no loss comparison")
    parser.add_argument(
        "--section", default=None, help="the docs/benchmarks.md section written (default: diloco; with --loss-only: diloco_loss)"
    )
    parser.add_argument(
        "--loss-only", nargs="*", default=None,
        help="only the loss part, for these DiLoCo variants (e.g. 'DiLoCo sync_every=16 outer_lr=1.0'); writes --section",
    )
    parser.add_argument("--worker", action="store_true", help="internal: one rank of one run")
    parser.add_argument("--variant", default="DDPStrategy")
    parser.add_argument("--model", default="large")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="")
    parser.add_argument("--validate", action="store_true", help="internal: rank 0 writes the validation loss after fit")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    h = args.sync_every
    if args.loss_only is not None:  # a sweep of the loss at equal tokens against DDP, on loopback
        return loss_sweep(args.loss_only, args.loss_steps, h, args.section or "diloco_loss")
    reason = available()
    if reason:
        raise SystemExit(f"benchmarks/diloco.py: {reason}")
    variants = [
        "DDPStrategy", f"DiLoCo sync_every={h}", f"DiLoCo sync_every={h} int8", f"DiLoCo sync_every={h} fragments=4",
        f"DiLoCo sync_every={h} fragments=4 overlap_steps=2", f"DiLoCo sync_every={NO_SYNC}",
    ]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp, SimulatedCluster(nodes=2, rate=args.rate) as cluster:
        for _ in range(args.rounds):
            for variant in variants:
                results[variant].append(run(variant, args.speed_model, args.steps, args.speed_batch, h, Path(tmp), cluster))
                print(variant, statistics.fmean(results[variant][-1]["times"][WARMUP:]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        losses = {v: loss_at_equal_tokens(v, args.loss_steps, h, Path(tmp)) for v in variants[:2]} if args.loss_steps else {}
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
        (ddp_train, ddp_val), (diloco_train, diloco_val) = (losses[v] for v in variants[:2])
        loss_line = f"""Loss at equal tokens (the example model, batch 16 x 64 bytes per rank, {args.loss_steps} steps on loopback, same seed
and data): validation loss after training (the whole held-out split) DDP {ddp_val:.4f}, DiLoCo sync_every={h}
{diloco_val:.4f}: **{diloco_val / ddp_val - 1:+.1%}** (target within 3%); training loss, mean of the last 20 steps,
DDP {ddp_train:.4f}, DiLoCo {diloco_train:.4f}: {diloco_train / ddp_train - 1:+.1%}."""
    command = " ".join(["sudo .venv/bin/python benchmarks/diloco.py", *sys.argv[1:]])
    write_section(args.section or "diloco", f"""## DiLoCo on a {args.rate} link

Command: `{command}` ({describe(benchmark_model(args.speed_model), args.speed_model)}, 2 simulated nodes on a {args.rate} link, one CPU process each, batch
{args.speed_batch} x 64 bytes per rank, {args.steps} steps; mean step time after {WARMUP} warm-up steps (sync steps included), ratio to
`DDPStrategy` in the same round, {args.rounds} alternating rounds, the median in bold and each round's in brackets;
machine: {machine()}). Targets (issue): step time <= 0.40x DDP's, bytes <= 1/sync_every of DDP's. Peak: the most
bytes one step sent (an overlapped sync's are counted at the step it lands, its traffic spread over the steps between).
`sync_every={NO_SYNC}`: no outer sync inside the timed steps, the same processes computing alone: the floor of every
DiLoCo variant here; a target below it is out of reach on this machine.

| variant | ms/step (mean) | step time / DDPStrategy: median (rounds) | MB sent per step per rank (share of DDP's) | peak MB in one step (share of DDP's step) |
|---|---|---|---|---|
""" + "\n".join(rows) + f"""

{loss_line}
""")


if __name__ == "__main__":
    main()
