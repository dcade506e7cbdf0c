"""The hierarchical expert dispatch against the flat one on two simulated nodes: bytes on the inter-node link, step
time; and each with its all-to-alls overlapped with compute (``expert_dispatch_overlap``) against without.

The model: the example DeepSeek-style decoder with DeepSeek-V3's group-limited routing (``MOE``: 32 routed experts in
4 groups, each token's 8 experts in its best 2 groups), ep=4 over dp=4 as 2 nodes of 2 ranks (``num_nodes=2,
devices=2``: the ep ranks' nodes are the cluster environment's, each node holds 2 whole groups, so a token reaches at
most 2 nodes); ``--per-node 1``: ep=2 over dp=2, a process per node (each with a core of its own). Both
dispatches route the same way (same seed, same data, the same maths: equal in float64,
tests/distributed/test_expert_dispatch.py).

Needs root (benchmarks/sim_cluster.py): two network namespaces joined by a ``--rate`` link, the processes in each (what
they send each other stays inside the namespace, off its link). Variants ``flat`` and ``hierarchical``, each with the
dispatch uncompressed and in ``fp8``, and each uncompressed with ``overlap`` (``expert_dispatch_overlap=True``: two
chunks per micro-batch, one's all-to-alls in flight while the other computes), alternating (the order reversed every
other round) for ``--rounds`` rounds of ``--steps`` steps. Per step, after ``WARMUP`` steps: the bytes that crossed the
inter-node link (the sum of both nodes' interface counters, ``tx_bytes``, every byte gloo sent, headers and the
data-parallel gradient sync included), the expert dispatch's own inter-node bytes as its counters count them
(``DispatchStats.link_bytes``: forward, summed over the ranks), the all-to-alls' wall time and the part the training
thread was blocked on them (``DispatchStats.seconds`` / ``exposed_seconds``, rank mean: the monitor's ``ep_comm`` /
``ep_exposed``), and the step time (median). Ratios per round (median and spread): the dispatches to ``flat`` with the
same compression; the overlapped ones to the same dispatch without overlap (target: step time <= 0.75x).

Planned beside: each variant planned with ``lightning_ciuic.planner`` for the same model, layout and micro-batch
(``--link intra=2GB/s,inter=<rate / processes per node>``: a node's link shared by its processes, as the plan's
per-device link speed), its compute rate and the latency of a collective call (an alpha-beta model:
``Hardware.latency``) fitted on ``flat`` and ``hierarchical`` without overlap (their steps are compute plus every all-to-all's bytes and calls; the
hierarchical dispatch makes more calls) and checked on the four others: the modelled step against the measured one
(target: the overlapped steps within 15%).

Writes the ``expert_dispatch`` section of docs/benchmarks.md (``expert_dispatch_per_node<N>_inter<D>_batch<B>`` for
another ``--per-node``, ``--moe-inter-dim`` or ``--batch-size``, each only where it differs; ``--dry-run``: prints it
only).

    sudo .venv/bin/python benchmarks/expert_dispatch.py [--rate 1gbit] [--steps 14] [--rounds 3] [--batch-size 8] [--moe-inter-dim 64] [--per-node 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.common import StepTimer, machine, spread, write_section  # noqa: E402
from benchmarks.sim_cluster import available, measured_rounds, node_benchmark_parser, run_measured  # noqa: E402

WARMUP = 4
SEQUENCE = 64  # tokens per sequence (ByteCorpusDataModule)
NODES = 2
MOE = dict(
    dim=128, n_layers=4, n_routed_experts=32, n_activated_experts=8, n_expert_groups=4, topk_expert_groups=2,
    moe_inter_dim=64, n_dense_layers=1,
)
INTRA_NODE = 2e9  # bytes/s, loopback inside a namespace (assumed; the intra-node hop carries little here)
VARIANTS = ("flat", "hierarchical", "flat fp8", "hierarchical fp8", "flat overlap", "hierarchical overlap")
FIT = ("flat", "hierarchical")  # the runs the plan's compute rate and latency are fitted on; the others check it
DISPATCHES = VARIANTS[:4]  # compared with flat of the same compression
OVERLAPPED = VARIANTS[4:]  # compared with the same dispatch without overlap


def _options(variant: str, per_node: int) -> dict:
    mode, *options = variant.split()
    codec = next((o for o in options if o != "overlap"), "none")
    return dict(
        data_parallel_size=NODES * per_node, expert_parallel_size=NODES * per_node, expert_dispatch=mode,
        expert_dispatch_compression=codec, expert_dispatch_overlap="overlap" in options,
    )


def _strategy(variant: str, per_node: int):
    from lightning_ciuic import HybridParallelStrategy

    return HybridParallelStrategy(**_options(variant, per_node))


def _plans(args: argparse.Namespace) -> dict:
    """Each variant planned on the fake process group (:mod:`lightning_ciuic.planner`), links as measured, compute at 1
    FLOP/s until fitted (``dataclasses.replace(plan, hardware=...)`` re-estimates)."""
    import torch

    from examples.deepseek import DeepSeekMini
    from lightning_ciuic.config import ParallelismConfig
    from lightning_ciuic.planner import plan_layout
    from lightning_ciuic.planner.config import optimizers_of
    from lightning_ciuic.planner.estimate import Hardware, parse_rate
    from lightning_ciuic.planner.train_step import StepSpec

    def build(mesh):
        with torch.device("meta"):
            return DeepSeekMini(**_model(args))

    hardware = Hardware(1.0, INTRA_NODE, parse_rate(f"{args.rate}/s") / args.per_node, devices_per_node=args.per_node, efficiency=1.0)
    return {
        variant: plan_layout(
            build, ParallelismConfig(**_options(variant, args.per_node), expert_devices_per_node=args.per_node), NODES * args.per_node,
            optimizers=optimizers_of, step=StepSpec(args.batch_size, SEQUENCE), hardware=hardware,
        )
        for variant in VARIANTS
    }


def _all_to_alls(plan) -> int:
    return sum(by.get("all_to_all", 0) for by in plan.pacing_step.calls.values())


def _fitted(plans: dict, measured: dict) -> tuple[dict, float, float]:
    """The plans at the compute rate and per-collective latency that make ``flat``'s and ``hierarchical``'s modelled
    steps (no overlap: compute plus every all-to-all) the measured ones: ``({variant: estimate}, rate, latency)``.
    The latency, from the two dispatches' different numbers of all-to-alls, is taken as 0 where the difference says
    less."""
    calls = [_all_to_alls(plans[v]) for v in FIT]
    free = [measured[v] - plans[v].estimate.exposed_expert_seconds for v in FIT]  # compute + calls x latency
    latency = max(0.0, (free[1] - free[0]) / (calls[1] - calls[0])) if calls[1] != calls[0] else 0.0
    rate = plans[FIT[0]].estimate.flops / (free[0] - latency * calls[0])
    estimates = {
        v: dataclasses.replace(p, hardware=dataclasses.replace(p.hardware, peak_flops=rate, latency=latency)).estimate
        for v, p in plans.items()
    }
    return estimates, rate, latency


def _tx_bytes(interface: str) -> int:
    path = Path(f"/sys/class/net/{interface}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else 0


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer, seed_everything

    from examples.data import ByteCorpusDataModule
    from examples.deepseek import DeepSeekMini

    interface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    report: dict = {}

    class Measure(Callback):
        """Interface and dispatch counters from the end of warm-up to the end of training, summed over the nodes."""

        def _counters(self, trainer) -> tuple[float, ...]:
            stats = trainer.strategy.parallelized.experts.stats
            inter = float(sum(by["inter"] for by in stats.link_bytes.values()))
            return float(_tx_bytes(interface)), inter, stats.seconds, stats.exposed_seconds

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == WARMUP:
                self.start = self._counters(trainer)

        def on_train_end(self, trainer, pl_module):
            steps = max(trainer.global_step - WARMUP, 1)
            end = self._counters(trainer)
            local_first = float(int(os.environ.get("LOCAL_RANK", "0")) == 0)  # one reader of each node's interface
            deltas = [e - s for e, s in zip(end, self.start)]
            mine = torch.tensor([deltas[0] * local_first, *deltas[1:]], dtype=torch.float64)
            dist.all_reduce(mine)
            wire, inter, comm, exposed = (float(v) / steps for v in mine)
            ranks = dist.get_world_size()
            report.update(wire_bytes_per_step=wire, dispatch_inter_bytes_per_step=inter, ep_comm=comm / ranks, ep_exposed=exposed / ranks)

    seed_everything(0)
    torch.set_num_threads(1)
    trainer = Trainer(
        strategy=_strategy(args.variant, args.per_node), accelerator="cpu", devices=args.per_node, num_nodes=NODES, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[StepTimer(args.out), Measure()],
    )
    trainer.fit(DeepSeekMini(**_model(args)), ByteCorpusDataModule(seq_len=SEQUENCE, batch_size=args.batch_size))
    if trainer.is_global_zero:
        Path(args.out + ".report").write_text(json.dumps(report))


def _model(args: argparse.Namespace) -> dict:
    return {**MOE, "moe_inter_dim": args.moe_inter_dim}


def run(variant: str, args: argparse.Namespace, workdir: Path, cluster) -> dict:
    out = workdir / f"{variant.replace(' ', '_')}.json"
    argv = [sys.executable, __file__, "--worker", "--variant", variant, "--steps", str(args.steps), "--batch-size",
            str(args.batch_size), "--moe-inter-dim", str(args.moe_inter_dim), "--per-node", str(args.per_node), "--out", str(out)]
    return run_measured(argv, out, cluster, NODES, args.per_node, WARMUP)


def measure(args: argparse.Namespace, workdir: Path) -> str:
    reason = available()
    if reason:
        return f"Not run: {reason}."
    results = measured_rounds(
        VARIANTS, args.rounds, NODES, args.rate, lambda variant, cluster: run(variant, args, workdir, cluster), "DISPATCH",
        lambda r: f"{r['step']:.3f} s, wire {r['wire_bytes_per_step'] / 1e6:.2f} MB/step, dispatch inter-node"
        f" {r['dispatch_inter_bytes_per_step'] / 1e6:.2f} MB/step",
    )
    rows, overlapped = [], []
    for variant in DISPATCHES:
        runs, flat = results[variant], results[variant.replace("hierarchical", "flat")]
        ratio = {key: [a[key] / b[key] for a, b in zip(runs, flat)] for key in ("wire_bytes_per_step", "dispatch_inter_bytes_per_step", "step")}
        rows.append(
            f"| {variant} | {statistics.median(r['wire_bytes_per_step'] for r in runs) / 1e6:.2f} | {spread(ratio['wire_bytes_per_step'])} |"
            f" {statistics.median(r['dispatch_inter_bytes_per_step'] for r in runs) / 1e6:.2f} | {spread(ratio['dispatch_inter_bytes_per_step'])} |"
            f" {statistics.median(r['step'] for r in runs):.3f} | {spread(ratio['step'])} |"
        )
    for variant in (v for pair in zip(DISPATCHES[:2], OVERLAPPED) for v in pair):
        runs, blocking = results[variant], results[variant.replace(" overlap", "")]
        step = [a["step"] / b["step"] for a, b in zip(runs, blocking)]
        hidden = [1 - r["ep_exposed"] / r["ep_comm"] if r["ep_comm"] else 0.0 for r in runs]
        overlapped.append(
            f"| {variant} | {statistics.median(r['step'] for r in runs):.3f} |"
            f" {spread(step) if variant in OVERLAPPED else '1'} | {statistics.median(r['ep_comm'] for r in runs) * 1e3:.0f} |"
            f" {statistics.median(r['ep_exposed'] for r in runs) * 1e3:.0f} | {statistics.median(hidden):.0%} |"
        )
    steps = {v: statistics.median(r["step"] for r in results[v]) for v in VARIANTS}
    plans = _plans(args)
    planned, rate, latency = _fitted(plans, steps)
    links = plans["flat"].hardware
    against_plan = [
        f"| {v} | {steps[v]:.3f} | {e.modelled_seconds:.3f} | {e.modelled_seconds / steps[v]:.2f}x |"
        f" {e.compute_seconds * 1e3:.0f} | {e.expert_seconds * 1e3:.0f} | {e.exposed_expert_seconds * 1e3:.0f} |"
        f" {_all_to_alls(plans[v])} | {'fit' if v in FIT else 'check'} |"
        for v, e in planned.items()
    ]
    return "\n".join([
        f"Two simulated nodes at {args.rate}, {args.per_node} processes each (ep={NODES * args.per_node} over"
        f" dp={NODES * args.per_node}), {args.steps} steps ({WARMUP} warm-up),"
        f" batch {args.batch_size} x 64 tokens per rank, {args.rounds} alternating rounds. Wire: both nodes' interface"
        " counters (tx_bytes; everything that crossed the link, the dense gradients' all-reduce included); dispatch:"
        " the expert dispatch's own inter-node bytes, forward (DispatchStats.link_bytes), summed over the ranks; ratios"
        " to flat with the same compression, per round.",
        "",
        "| dispatch | wire MB/step | vs flat | dispatch inter-node MB/step | vs flat | step (s) | vs flat |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Target (hierarchical against flat, same routing): bytes crossing the inter-node link per step <= 0.5x.",
        "",
        "Overlap (expert_dispatch_overlap: two chunks per micro-batch, one's all-to-alls in flight while the other"
        " computes, forward and backward): step time against the same dispatch without overlap, per round; the expert"
        " all-to-alls' wall time per step (ep_comm: issue to completion) and the part the training thread was blocked"
        " on them (ep_exposed), rank mean; hidden = 1 - ep_exposed / ep_comm.",
        "",
        "| dispatch | step (s) | vs without overlap | ep_comm (ms/step) | ep_exposed (ms/step) | hidden |",
        "|---|---|---|---|---|---|",
        *overlapped,
        "",
        "Target: step time with overlap <= 0.75x of without.",
        "",
        f"Planned against measured: each variant planned for the same model, layout and micro-batch (the fake process"
        f" group), links {links.intra_node / 1e9:g} GB/s intra-node and {args.rate} over {args.per_node} processes"
        f" inter-node ({links.inter_node / 1e6:g} MB/s per process), the compute rate ({rate / 1e9:.2f} GFLOP/s per"
        f" process) and the latency of a collective call ({latency * 1e3:.2f} ms) fitted on {' and '.join(FIT)} without"
        " overlap, and checked on the others; planned compute, expert all-to-alls (E, bytes and calls) and their"
        " exposed part, ms per step; the plan's all-to-all calls per rank and step.",
        "",
        "| variant | measured step (s) | planned step (s) | planned / measured | compute | E | exposed | all-to-alls | |",
        "|---|---|---|---|---|---|---|---|---|",
        *against_plan,
        "",
        "Target: the overlapped steps within 15% of the measured.",
    ])


def main() -> None:
    parser = node_benchmark_parser("flat", steps=14)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--moe-inter-dim", type=int, default=MOE["moe_inter_dim"], help="each routed expert's hidden width")
    parser.add_argument("--per-node", type=int, default=2, help="processes per simulated node (ep = dp = 2 x this)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from examples.deepseek import DeepSeekMini
    from lightning_ciuic.parallel.experts import packed_experts

    model = DeepSeekMini(**_model(args))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for _, m in packed_experts(model) for p in m.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        section = "\n".join([
            "## Expert parallelism: hierarchical dispatch and overlap",
            "",
            f"`sudo .venv/bin/python benchmarks/expert_dispatch.py --rate {args.rate} --steps {args.steps} --rounds"
            f" {args.rounds} --batch-size {args.batch_size} --moe-inter-dim {args.moe_inter_dim} --per-node {args.per_node}`"
            f" on {machine()}. Model:"
            " the example decoder with"
            f" {MOE['n_routed_experts']} routed experts per layer in {MOE['n_expert_groups']} groups, each token's"
            f" {MOE['n_activated_experts']} in its best {MOE['topk_expert_groups']} groups, {total / 1e6:.2f}M parameters"
            f" of which {experts / 1e6:.2f}M in routed experts.",
            "",
            measure(args, Path(tmp)),
        ])
    print(section)
    if not args.dry_run:
        write_section(section_name(args), section)


def section_name(args: argparse.Namespace) -> str:
    """``expert_dispatch``, then ``_per_node<N>``, ``_inter<D>``, ``_batch<B>`` for each that is not the default."""
    name = "expert_dispatch"
    for suffix, value, default in (("per_node", args.per_node, 2), ("inter", args.moe_inter_dim, MOE["moe_inter_dim"]),
                                   ("batch", args.batch_size, 8)):
        if value != default:
            name += f"_{suffix}{value}"
    return name


if __name__ == "__main__":
    main()
