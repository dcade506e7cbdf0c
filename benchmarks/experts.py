"""Expert parallelism, measured side by side: memory, bytes on the wire and step time, compressed dispatch, balance.

The model: the example DeepSeek-style decoder with 16 routed experts per layer (``MOE``), whose experts hold most of
its parameters. Every run is two ranks, one process per node (``benchmarks/sim_cluster.run_two_nodes``).

1. Link (``--parts link``; needs root, benchmarks/sim_cluster.py): two simulated nodes joined by a ``--rate`` link.
   Variants: Lightning's ``DDPStrategy``, plain FSDP (``data_parallel_shard_size=2``) and FSDP with the experts
   sharded (``expert_parallel_size=2``), alternating for ``--rounds`` rounds of ``--steps`` steps. Bytes on the wire
   per step from the node's interface counter (``tx_bytes`` of its link, read inside its namespace: every byte gloo
   sent, headers included), step time the median after warm-up; both as ratios to plain FSDP and to DDP, per round.
2. Memory (``--parts memory``, loopback): expert parameter + gradient + AdamW-state bytes one rank holds after a step,
   with ``expert_parallel_size`` 1 and 2 over a replicated dp=2.
3. Dispatch and balance (``--parts dispatch``, loopback): ``--dispatch-steps`` steps of ep=2 over dp=2 with the
   dispatch ``none``, ``bf16``, ``fp8``, ``int8``, and ``none`` with :class:`~lightning_ciuic.ExpertLoadBalancer`
   (rate 1e-3), same seed and data: dispatch bytes per step, validation loss after training (the whole held-out
   split), and max / mean tokens per expert over the last 20 steps (all ranks' tokens, the worst layer).

Writes the ``experts_link``, ``experts_memory`` and ``experts_dispatch`` sections of docs/benchmarks.md.

    sudo .venv/bin/python benchmarks/experts.py [--parts link,memory,dispatch] [--rate 1gbit] [--steps 14]
        [--rounds 3] [--dispatch-steps 300]
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

from benchmarks.common import StepTimer, alternating, machine, median_after_warmup, spread, write_section  # noqa: E402
from benchmarks.sim_cluster import SimulatedCluster, available, run_two_nodes  # noqa: E402

WARMUP = 4
MOE = dict(dim=128, n_layers=4, n_routed_experts=16, n_activated_experts=2, moe_inter_dim=192, n_dense_layers=1)
LINK_VARIANTS = ("DDPStrategy", "FSDP", "FSDP + EP")
DISPATCH_VARIANTS = ("none", "bf16", "fp8", "int8", "none + balancer")


def _strategy(variant: str):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ciuic import HybridParallelStrategy

    if variant == "DDPStrategy":
        return DDPStrategy()
    if variant == "FSDP":
        return HybridParallelStrategy(data_parallel_shard_size=2)
    if variant == "FSDP + EP":
        return HybridParallelStrategy(data_parallel_shard_size=2, expert_parallel_size=2)
    if variant.startswith("ep1"):
        return HybridParallelStrategy()
    return HybridParallelStrategy(expert_parallel_size=2, expert_dispatch_compression=variant.split()[0])


def _tx_bytes(node_interface: str) -> int:
    path = Path(f"/sys/class/net/{node_interface}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else 0


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything

    from examples.data import ByteCorpusDataModule
    from examples.deepseek import DeepSeekMini
    from lightning_ciuic import ExpertLoadBalancer
    from lightning_ciuic.parallel.experts import RoutedTokens, packed_experts
    from lightning_ciuic.tensors import local_tensor

    interface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    report: dict = {}

    class Measure(Callback):
        """Wire bytes after warm-up, routed tokens of the last 20 steps, expert bytes held, dispatch bytes."""

        def on_fit_start(self, trainer, pl_module):
            self.routed = RoutedTokens(pl_module)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == WARMUP:
                self.tx = _tx_bytes(interface)
            if trainer.global_step == args.steps - 20:
                self.routed.take()

        def on_train_end(self, trainer, pl_module):
            steps = trainer.global_step - WARMUP
            report["wire_bytes_per_step"] = (_tx_bytes(interface) - getattr(self, "tx", 0)) / max(steps, 1)
            worst = 0.0
            for load in self.routed.take().values():
                load = load.double()
                dist.all_reduce(load)
                worst = max(worst, float(load.max() / load.mean()))
            report["max_over_mean"] = worst
            experts = [p for _, m in packed_experts(pl_module) for p in (m.gate_up_proj, m.down_proj)]
            state = trainer.optimizers[0].state
            held = sum(local_tensor(t).numel() * local_tensor(t).element_size() for p in experts
                       for t in (p, p.grad, *[v for v in state.get(p, {}).values() if v.dim() > 0]) if t is not None)
            report["expert_bytes"] = held
            layout = getattr(trainer.strategy, "parallelized", None)
            stats = layout.experts.stats if layout is not None and layout.experts is not None else None
            report["dispatch_bytes_per_step"] = stats.dispatch_bytes / trainer.global_step if stats else 0
            report["dispatch_bytes_per_row"] = stats.dispatch_bytes / max(stats.dispatch_rows, 1) if stats else 0

    seed_everything(0)
    torch.set_num_threads(1)
    callbacks = [StepTimer(args.out), Measure()]
    if args.variant.endswith("balancer"):
        callbacks.append(ExpertLoadBalancer(bias_update_rate=1e-3))
    trainer = Trainer(
        strategy=_strategy(args.variant), accelerator="cpu", devices=1, num_nodes=2, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=callbacks,
    )
    module, data = DeepSeekMini(**MOE), ByteCorpusDataModule(seq_len=64, batch_size=args.batch_size)
    trainer.fit(module, data)
    if args.validate:
        from benchmarks.diloco import validation_loss

        report["val_loss"] = validation_loss(_whole(trainer, module), data)
    if trainer.is_global_zero:
        Path(args.out + ".report").write_text(json.dumps(report))


def _whole(trainer, module):
    """A single-process copy of the trained module (expert shards gathered), for the validation pass."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from examples.deepseek import DeepSeekMini

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    whole = DeepSeekMini(**MOE)
    whole.load_state_dict(state)
    return whole


def run(variant: str, steps: int, workdir: Path, cluster, batch: int = 8, validate: bool = False) -> dict:
    out = workdir / f"{variant.replace(' ', '_').replace('+', 'p')}-{steps}.json"
    argv = [sys.executable, __file__, "--worker", "--variant", variant, "--steps", str(steps), "--batch-size",
            str(batch), "--out", str(out)] + ["--validate"] * validate
    run_two_nodes(argv, cluster)
    return {**json.loads(out.read_text()), **json.loads(Path(str(out) + ".report").read_text())}


def link_part(args, workdir: Path) -> str:
    reason = available()
    if reason:
        return f"Link part not run: {reason}."
    results: dict[str, list[dict]] = {v: [] for v in LINK_VARIANTS}
    with SimulatedCluster(nodes=2, rate=args.rate) as cluster:
        for r, variant in alternating(LINK_VARIANTS, args.rounds):
            result = run(variant, args.steps, workdir, cluster)
            result["step"] = median_after_warmup(result["times"], WARMUP)
            results[variant].append(result)
            print(f"LINK round {r} {variant}: {result['step']:.3f} s, {result['wire_bytes_per_step'] / 1e6:.2f} MB/step", flush=True)
    rows = []
    for variant in LINK_VARIANTS:
        runs = results[variant]
        time_fsdp = [a["step"] / b["step"] for a, b in zip(runs, results["FSDP"])]
        time_ddp = [a["step"] / b["step"] for a, b in zip(runs, results["DDPStrategy"])]
        wire_fsdp = [a["wire_bytes_per_step"] / b["wire_bytes_per_step"] for a, b in zip(runs, results["FSDP"])]
        wire_ddp = [a["wire_bytes_per_step"] / b["wire_bytes_per_step"] for a, b in zip(runs, results["DDPStrategy"])]
        rows.append(
            f"| {variant} | {statistics.median(r['step'] for r in runs):.3f} | {spread(time_fsdp)} | {spread(time_ddp)} |"
            f" {statistics.median(r['wire_bytes_per_step'] for r in runs) / 1e6:.2f} | {spread(wire_fsdp)} | {spread(wire_ddp)} |"
        )
    return "\n".join([
        f"Two simulated nodes at {args.rate}, one process each, {args.steps} steps ({WARMUP} warm-up), {args.rounds}"
        " alternating rounds; wire bytes are the node's interface counter (tx_bytes).",
        "",
        "| variant | step (s) | vs FSDP | vs DDP | wire MB/step | vs FSDP | vs DDP |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Targets (FSDP + EP against FSDP): wire bytes <= 0.25x, step time <= 0.6x.",
    ])


def memory_part(workdir: Path) -> str:
    held = {variant: run(variant, 2, workdir, None)["expert_bytes"] for variant in ("ep1 (replicated)", "none")}
    ratio = held["none"] / held["ep1 (replicated)"]
    return (
        f"Expert parameter + gradient + AdamW-state bytes on one rank (dp=2): ep=1 {held['ep1 (replicated)'] / 1e6:.2f} MB,"
        f" ep=2 {held['none'] / 1e6:.2f} MB: **{ratio:.3f}x** (target <= 1/2 + 10% = 0.55x)."
    )


def dispatch_part(args, workdir: Path) -> str:
    results = {v: run(v, args.dispatch_steps, workdir, None, validate=True) for v in DISPATCH_VARIANTS}
    for variant, result in results.items():
        print(f"DISPATCH {variant}: {result['dispatch_bytes_per_step'] / 1e3:.1f} kB/step, val {result['val_loss']:.4f},"
              f" max/mean {result['max_over_mean']:.3f}", flush=True)
    bf16, none = results["bf16"], results["none"]
    rows = [
        f"| {variant} | {r['dispatch_bytes_per_step'] / 1e3:.1f} | {r['dispatch_bytes_per_row']:.1f} |"
        f" {r['dispatch_bytes_per_row'] / bf16['dispatch_bytes_per_row']:.3f}x |"
        f" {r['val_loss']:.4f} | {r['val_loss'] / none['val_loss'] - 1:+.2%} | {r['max_over_mean']:.3f} |"
        for variant, r in results.items()
    ]
    return "\n".join([
        f"ep=2 over dp=2 on loopback, {args.dispatch_steps} steps, same seed and data; dispatch bytes this rank sent to"
        " the other's experts, per step and per row sent (one token for one expert: how many rows cross depends on"
        " where the router sent them, which differs between runs, so the codecs compare per row); validation loss on"
        " the whole held-out split; max / mean tokens per expert over the last 20 steps (both ranks' tokens, worst"
        " layer).",
        "",
        "| dispatch | kB/step | bytes/row | vs bf16 (per row) | val loss | vs none | max/mean tokens per expert |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Targets: fp8/int8 dispatch bytes <= 0.55x of bf16's (per row), validation loss within 1%; the balancer lowers"
        " max / mean.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--variant", default="FSDP")
    parser.add_argument("--out", default="")
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--parts", default="link,memory,dispatch")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dispatch-steps", type=int, default=300)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from examples.deepseek import DeepSeekMini
    from lightning_ciuic.parallel.experts import packed_experts

    model = DeepSeekMini(**MOE)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for _, m in packed_experts(model) for p in m.parameters())
    parts = {"link": ("Link", lambda w: link_part(args, w)), "memory": ("Memory", memory_part),
             "dispatch": ("Dispatch and balance", lambda w: dispatch_part(args, w))}
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts.split(","):
            title, measure = parts[part]
            write_section(f"experts_{part}", "\n".join([
                f"## Expert parallelism: {title.lower()}",
                "",
                f"`sudo .venv/bin/python benchmarks/experts.py --parts {part} --rate {args.rate} --steps {args.steps}"
                f" --rounds {args.rounds} --dispatch-steps {args.dispatch_steps}` on {machine()}. Model: the example"
                f" decoder with {MOE['n_routed_experts']} routed experts per layer, {total / 1e6:.2f}M parameters of"
                f" which {experts / 1e6:.2f}M in routed experts.",
                "",
                measure(Path(tmp)),
            ]))


if __name__ == "__main__":
    main()
