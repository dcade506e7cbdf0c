"""Compressed gradient sync on a simulated 2-node cluster, side by side with Lightning's DDPStrategy.

Three parts, each a set of runs with 2 processes (one per simulated node, gloo, ``num_nodes=2``):

1. speed: the "large" model (>= 8M parameters) on capped links, for each ``RATE:BATCH`` of ``--speed-runs``:
   median step time, bytes this rank sent per step, ratio to ``DDPStrategy`` (fp32). Every mode of ours,
   plus torch's fp16 and PowerSGD DDP hooks registered on Lightning's DDP model;
2. fast link: the same model on loopback: ``"auto"`` against uncompressed, ``--loopback-rounds`` alternating pairs;
3. loss: the example model for ``--loss-steps`` steps per mode (same seed and data order, loopback); mean
   training loss of the last 20 steps against uncompressed, under the example's AdamW and under SGD with
   momentum (where error feedback's convergence guarantees are proven).

Needs root and iproute2 for part 1 (see benchmarks/sim_cluster.py); says so and skips it otherwise.
``--parts speed`` (1 and 2) writes the ``compression`` section of docs/benchmarks.md, ``--parts loss`` (3)
the ``compression_loss`` section; both by default.

    .venv/bin/python benchmarks/compression.py [--parts speed loss] [--steps 25] [--speed-runs 1gbit:16 1gbit:4 200mbit:4]
        [--loss-steps 200] [--sgd-lr 0.1]
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

from benchmarks.common import MODELS, machine, median_after_warmup, write_section  # noqa: E402
from benchmarks.sim_cluster import SimulatedCluster, available, run_two_nodes  # noqa: E402
from lightning_ciuic.comm.auto import CANDIDATES, SETTLE_STEPS, TRIAL_STEPS  # noqa: E402

OURS = ["none", "fp16", "fp16 feedback 1", "bf16", "int8", "nf4", "topk", "powersgd", "powersgd rank 16", "auto"]
NO_SYNC = "no gradient sync"  # the floor: the same two processes, replicas never synchronised (DiLoCo that never syncs)
HOOK = "DDP + torch fp16 hook"
DDP_VARIANTS = ["DDPStrategy", HOOK, "DDP + torch PowerSGD hook"]
WARMUP = 5
AUTO_TRIAL = SETTLE_STEPS + len(CANDIDATES) * TRIAL_STEPS
LOSS_VARIANTS = ["none", "fp16", "fp16 feedback 1", "bf16", "int8", "nf4", "topk", "topk warm-up 20", "powersgd", "powersgd warm-up 20",
                 "powersgd rank 16"]
SGD_LOSS_VARIANTS = ["none", "int8", "nf4", "topk", "topk warm-up 20", "powersgd", "powersgd warm-up 20", "powersgd rank 16"]


def _strategy(variant: str):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ciuic import HybridParallelStrategy

    if variant in DDP_VARIANTS:
        return DDPStrategy()
    if variant == NO_SYNC:
        from lightning_ciuic import DiLoCo

        return HybridParallelStrategy(diloco=DiLoCo(sync_every=10**9))
    mode, *options = variant.split(" ")  # e.g. "topk warm-up 20", "powersgd rank 16"
    settings = dict(zip(options[::2], map(int, options[1::2])))
    return HybridParallelStrategy(
        communication_compression=mode, compression_ratio=0.01, powersgd_rank=settings.get("rank", 4),
        compression_warmup_steps=settings.get("warm-up", 0),
        error_feedback=bool(settings["feedback"]) if "feedback" in settings else None,
    )


class _TorchHook:
    """Registers one of torch's own DDP hooks on Lightning's DDP model (Lightning does so on CUDA only)."""

    def __init__(self, variant: str) -> None:
        self.variant = variant

    def __call__(self, ddp_model) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.variant == "DDP + torch fp16 hook":
            ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.variant == "DDP + torch PowerSGD hook":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
            ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def worker(args: argparse.Namespace) -> None:
    """One rank of one run (started inside a node): trains and writes step times, bytes and losses."""
    import time

    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from examples.data import ByteCorpusDataModule
    from examples.deepseek import DeepSeekMini
    from lightning_ciuic import parallel_context

    class Probe(Callback):
        def __init__(self) -> None:
            self.times, self.losses, self.bytes, self.start = [], [], [], 0.0

        def on_fit_start(self, trainer, pl_module):
            if args.variant in DDP_VARIANTS[1:]:
                _TorchHook(args.variant)(trainer.strategy.model)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.start)
            self.losses.append(float(outputs["loss"]))
            sync = getattr(parallel_context(trainer).data_parallel, "synchronizer", None)
            self.bytes.append(sync.stats.bytes_sent if sync else None)

        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                auto_compression = getattr(parallel_context(trainer).data_parallel, "auto", None)
                history = auto_compression.history if auto_compression is not None else []
                auto, auto_modes = [d.reason for d in history], [d.mode for d in history]
                params = sum(p.numel() for p in pl_module.parameters())
                Path(args.out).write_text(json.dumps(
                    {"times": self.times, "losses": self.losses, "bytes": self.bytes, "auto": auto, "auto_modes": auto_modes,
                     "params": params}
                ))

    seed_everything(0)
    torch.set_num_threads(1)
    callbacks = [Probe()]
    if args.monitor_dir:  # benchmarks/monitor.py: the communication monitor, optionally with a straggler
        from lightning_ciuic import CommunicationMonitor
        from lightning_ciuic.testing import SlowRank

        callbacks.append(CommunicationMonitor(dirpath=args.monitor_dir))
        if args.straggler:
            callbacks.append(SlowRank([1], slowdown=2.0))
    trainer = Trainer(
        strategy=_strategy(args.variant), accelerator="cpu", devices=1, num_nodes=2, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=callbacks,
    )
    model = DeepSeekMini(**MODELS[args.model])
    if args.sgd:  # the loss comparison under SGD with momentum, where error feedback's guarantees are proven
        model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=args.sgd_lr, momentum=0.9)
    trainer.fit(model, ByteCorpusDataModule(seq_len=64, batch_size=args.batch_size))


def run(
    variant: str, model: str, steps: int, workdir: Path, cluster: SimulatedCluster | None, batch_size: int = 16,
    extra_args: tuple[str, ...] = (),
) -> dict:
    """Train ``variant`` on two processes (loopback, or one per node of ``cluster``); the rank-0 probe's results."""
    out = workdir / f"{variant.replace(' ', '_')}-{model}-{steps}-{batch_size}-{'_'.join(extra_args).replace('/', '')}.json"
    argv = [sys.executable, __file__, "--worker", "--variant", variant, "--model", model, "--steps", str(steps),
            "--batch-size", str(batch_size), "--out", str(out), *extra_args]
    run_two_nodes(argv, cluster)
    return json.loads(out.read_text())


def summarize(result: dict) -> tuple[float, float | None]:
    """Median step time and bytes per step after warm-up (for "auto": after its trial of the candidates)."""
    skip = WARMUP + (AUTO_TRIAL if result["auto"] else 0)
    step = median_after_warmup(result["times"], skip)
    sent = result["bytes"]
    per_step = (sent[-1] - sent[skip - 1]) / (len(sent) - skip) if sent[-1] is not None else None
    return step, per_step


def speed_section(rate: str, steps: int, workdir: Path, batch_size: int, rounds: int, variants: list[str]) -> str:
    """Every variant once per round, ``rounds`` alternating rounds; ratios to DDPStrategy (and to DDP with torch's
    fp16 hook, when it ran) paired within a round, the median over rounds in bold and each round's in brackets."""
    variants = ["DDPStrategy"] + [v for v in DDP_VARIANTS + OURS + [NO_SYNC] if v in variants and v != "DDPStrategy"]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    failures: dict[str, str] = {}
    with SimulatedCluster(nodes=2, rate=rate) as cluster:
        for _ in range(rounds):
            for variant in variants:
                if variant in failures:
                    continue
                try:
                    extra = AUTO_TRIAL if variant == "auto" else 0
                    results[variant].append(run(variant, "large", steps + extra, workdir, cluster, batch_size))
                    print(batch_size, variant, summarize(results[variant][-1]), flush=True)
                except RuntimeError as err:  # reported in the table, not hidden
                    failures[variant] = str(err)
    ddp_steps = [summarize(r)[0] for r in results["DDPStrategy"]]
    hook = HOOK if results.get(HOOK) and HOOK not in failures else None
    hook_steps = [summarize(r)[0] for r in results[hook]] if hook else []
    params = results["DDPStrategy"][0]["params"]
    fp32_bytes = 4 * params  # a ring all-reduce of float32 sends 2 (w-1)/w = 1x the gradient per rank at w=2
    rows = []
    for variant in variants:
        if variant in failures:
            rows.append(f"| {variant} | failed | {failures[variant]} | |" + (" |" if hook else ""))
            continue
        measured = [summarize(r) for r in results[variant]]
        sent = measured[-1][1]
        share = "" if sent is None else f"{sent / 1e6:.2f} MB ({sent / fp32_bytes:.1%})"
        columns = [_paired(measured, ddp_steps)] + ([_paired(measured, hook_steps)] if hook else [])
        rows.append(f"| {variant} | {statistics.median(s for s, _ in measured) * 1e3:.0f} | {' | '.join(columns)} | {share} |")
    auto_runs = results.get("auto") or [{}]
    auto_reason = auto_runs[-1].get("auto", [""])[0] if auto_runs[-1].get("auto") else ""
    return (
        f"### Speed on a simulated {rate} link ({params / 1e6:.2f}M-parameter model, batch {batch_size} x 64 bytes per rank, {rounds} rounds)\n\n"
        f"| variant | ms/step (median) | step time / DDPStrategy: median (rounds) |"
        + (" step time / DDP + torch fp16 hook: median (rounds) |" if hook else "")
        + " bytes sent per step per rank (share of fp32) |\n"
        + f"|---|---|---|{'---|' if hook else ''}---|\n" + "\n".join(rows)
        + (f"\n\n`auto` said (last round): {auto_reason}" if auto_reason else "")
    )


def _paired(measured: list[tuple[float, float | None]], reference: list[float]) -> str:
    """Step time over the reference's in the same round: the median in bold, each round's in brackets."""
    ratios = [step / ref for (step, _), ref in zip(measured, reference)]
    return f"**{statistics.median(ratios):.2f}** ({', '.join(f'{r:.2f}' for r in ratios)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--variant", default="none")
    parser.add_argument("--model", default="large")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--loss-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="worker: samples of 64 bytes per rank")
    parser.add_argument("--speed-runs", nargs="+", default=["1gbit:16", "1gbit:4", "200mbit:4"],
                        help="RATE:BATCH pairs for the simulated-cluster speed tables")
    parser.add_argument("--loopback-rounds", type=int, default=3, help="alternating none/auto pairs on loopback")
    parser.add_argument("--speed-rounds", type=int, default=2, help="alternating rounds of every variant per speed run")
    parser.add_argument("--parts", nargs="+", choices=["speed", "loss"], default=["speed", "loss"])
    parser.add_argument("--variants", nargs="+", choices=DDP_VARIANTS + OURS + [NO_SYNC], default=DDP_VARIANTS + OURS,
                        help="speed runs: the variants to run (DDPStrategy always runs: the ratios' reference)")
    parser.add_argument("--section", default="compression",
                        help="the docs/benchmarks.md section written (the loss part: <section>_loss)")
    parser.add_argument("--loss-variants", nargs="+", default=None,
                        help="loss: only these (and none), under AdamW (default: every mode under both optimizers)")
    parser.add_argument("--sgd-lr", type=float, default=0.1, help="LR of the loss comparison under SGD with momentum 0.9")
    parser.add_argument("--sgd", action="store_true", help="worker: train with SGD (momentum 0.9, --sgd-lr) instead of AdamW")
    parser.add_argument("--out", default="")
    parser.add_argument("--monitor-dir", default="", help="worker: add a CommunicationMonitor writing here")
    parser.add_argument("--straggler", action="store_true", help="worker: slow rank 1 down 2x (with --monitor-dir)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    with tempfile.TemporaryDirectory() as tmp:
        if "speed" in args.parts:
            speed_part(args, Path(tmp))
        if "loss" in args.parts:
            loss_part(args, Path(tmp))


def speed_part(args: argparse.Namespace, workdir: Path) -> None:
    """The ``compression`` section: every mode on capped links and on loopback."""
    sections = []
    reason = available()
    if reason:
        sections.append(f"### Speed on a simulated cluster\n\nSkipped: {reason}.")
    for pair in [] if reason else args.speed_runs:
        rate, batch_size = pair.split(":")
        sections.append(speed_section(rate, args.steps, workdir, int(batch_size), args.speed_rounds, args.variants))

    rounds = []  # alternating pairs: one pair's ratio moves by several percent on this machine (0 rounds: none)
    for _ in range(args.loopback_rounds):
        pair = {v: run(v, "large", args.steps + (AUTO_TRIAL if v == "auto" else 0), workdir, None)
                for v in ("none", "auto")}
        rounds.append((summarize(pair["none"])[0], summarize(pair["auto"])[0], pair["auto"]))
    if rounds:
        sections.append(_loopback_section(rounds))
    body = "\n\n".join(sections)
    title = "Compressed gradient synchronization" if args.section == "compression" else "Dense codecs against torch's DDP fp16 hook"
    write_section(
        args.section,
        f"""
## {title} on a simulated 2-node cluster

Command: `.venv/bin/python {shlex.join(['benchmarks/compression.py', *sys.argv[1:]])}`
(2 processes, one per network namespace, 1 intra-op thread each, gloo, `num_nodes=2`; both "nodes" share this
machine's 2 cores, so codec time competes with compute as it would not on two real nodes; median step time after {WARMUP} warm-up steps, for `auto` after its {AUTO_TRIAL}-step trial of the candidates; machine: {machine()}). Targets at 1 Gbit/s: int8 step time
<= 0.45x DDPStrategy, bytes <= 27% of fp32 (nf4 <= 15%, top-k 1% <= 3%); fp16 no slower than DDP + torch's fp16
hook, int8 <= 0.85x of it; auto <= 1.05x uncompressed on loopback.

{body}
""",
    )


def _loopback_section(rounds: list[tuple[float, float, dict]]) -> str:
    """``auto`` against uncompressed on loopback: the median ratio of the alternating pairs."""
    ratios = [auto / none for none, auto, _ in rounds]
    none_step, auto_step, last = rounds[-1]
    return (
        f"### Fast link (loopback), {len(rounds)} alternating rounds\n\n"
        f"auto / uncompressed step time, median of rounds: **{statistics.median(ratios):.2f}** (target <= 1.05; rounds: "
        + ", ".join(f"{ratio:.2f}" for ratio in ratios)
        + f"). Last round: uncompressed {none_step * 1e3:.0f} ms/step, auto {auto_step * 1e3:.0f} ms/step.\n\n"
        "`auto` chose, per round: " + ", ".join(", ".join(r["auto_modes"]) for _, _, r in rounds)
        + f". It said in the last round: {last['auto'][0] if last['auto'] else ''}"
    )


def _loss_table(losses: dict[str, list[float]]) -> str:
    reference = sum(losses["none"][-20:]) / 20
    rows = [f"| {v} | {sum(l[-20:]) / 20:.4f} | **{(sum(l[-20:]) / 20 - reference) / reference:+.2%}** |" for v, l in losses.items()]
    return "| mode | mean train loss, last 20 steps | vs uncompressed |\n|---|---|---|\n" + "\n".join(rows)


def loss_part(args: argparse.Namespace, workdir: Path) -> None:
    """The ``compression_loss`` section: the example model's loss per mode, under AdamW and under SGD; with
    ``--loss-variants``, those (and ``none``) under AdamW only, into ``<--section>_loss``."""
    subset = args.loss_variants is not None
    variants = ["none", *[v for v in args.loss_variants if v != "none"]] if subset else LOSS_VARIANTS
    adamw = {v: run(v, "example", args.loss_steps, workdir, None)["losses"] for v in variants}
    sgd_args = ("--sgd", "--sgd-lr", str(args.sgd_lr))
    sgd = {} if subset else {
        v: run(v, "example", args.loss_steps, workdir, None, extra_args=sgd_args)["losses"] for v in SGD_LOSS_VARIANTS
    }
    sgd_part = f"\n### SGD with momentum 0.9, lr {args.sgd_lr}\n\n{_loss_table(sgd)}\n" if sgd else ""
    write_section(
        f"{args.section}_loss",
        f"""
## Compressed gradient synchronization: loss after {args.loss_steps} steps

Command: `.venv/bin/python {shlex.join(['benchmarks/compression.py', *sys.argv[1:]])}`
(example model, 2 processes on loopback, batch 16 x 64 bytes per rank, same seed and data order, error feedback
as each mode's default (on for int8, nf4, top-k, PowerSGD; off for fp16/bf16 unless "feedback 1");
machine: {machine()}). Target: within 2% of uncompressed for int8, nf4 and PowerSGD, 5% for top-k.

### AdamW (the example model's optimizer: lr 3e-3, betas 0.9/0.95)

{_loss_table(adamw)}
{sgd_part}""",
    )


if __name__ == "__main__":
    main()
