"""CommunicationMonitor: is its advice right, and what does it cost?

Same two-process runs as ``benchmarks/compression.py`` (its ``run``: one process per simulated node, gloo,
1 thread each; model ``large``, 8.6M parameters):

1. simulated 1 Gbit/s cluster: uncompressed training with the monitor; its advice (and its predicted speed-up
   for every dense compression mode); then each mode run for real. Target: the recommended mode's predicted
   gain within 25% of the measured one;
2. loopback: uncompressed with and without the monitor, alternating for ``--rounds`` rounds (overhead, target
   <= 2%), and the advice there (target: no compression recommended);
3. loopback with rank 1 slowed 2x (``SlowRank``): the advice must name rank 1.

Writes the ``monitor`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/monitor.py [--steps 25] [--rounds 3] [--batch 4] [--overhead-steps 80]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine, median_after_warmup, write_section  # noqa: E402
from benchmarks.compression import WARMUP, run  # noqa: E402
from benchmarks.sim_cluster import SimulatedCluster, available  # noqa: E402
from lightning_ciuic.advice import RunProfile, advise, compression_speedups  # noqa: E402

MODES = ("none", "fp16", "int8", "nf4")


def monitored(workdir: Path, name: str, steps: int, cluster, batch: int, straggler: bool = False) -> tuple[float, RunProfile]:
    out = workdir / f"monitor-{name}"
    extra = ("--monitor-dir", str(out), *(("--straggler",) if straggler else ()))
    result = run("none", "large", steps, workdir, cluster, batch, extra_args=extra)
    profile = RunProfile.from_json(json.loads((out / "monitor.json").read_text())["profile"])
    return median_after_warmup(result["times"], WARMUP), profile


def advice_lines(profile: RunProfile) -> str:
    return "\n".join(f"  - {a.summary} (`{a.argument.split('   ')[0]}`)" for a in advise(profile)) or "  - none"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="samples of 64 bytes per rank")
    parser.add_argument("--overhead-steps", type=int, default=80, help="steps of each loopback overhead run")
    args = parser.parse_args()
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        reason = available()
        if reason:
            sections.append(f"### Simulated 1 Gbit/s cluster\n\nSkipped: {reason}.")
        else:
            with SimulatedCluster(nodes=2, rate="1gbit") as cluster:
                _, profile = monitored(workdir, "1gbit", args.steps, cluster, args.batch)
                steps: dict[str, list[float]] = {m: [] for m in MODES}
                for _ in range(args.rounds):  # alternating: every mode once per round
                    for m in MODES:
                        steps[m].append(median_after_warmup(run(m, "large", args.steps, workdir, cluster, args.batch)["times"], WARMUP))
            # speed-up of each mode against none of the same round; the median over rounds, the rounds in brackets
            per_round = {m: [none / step for none, step in zip(steps["none"], steps[m])] for m in MODES}
            speedup = {m: statistics.median(values) for m, values in per_round.items()}
            predicted = compression_speedups(profile)
            advice = [a for a in advise(profile) if a.rule == "compression"]
            rows = "\n".join(
                f"| {m} | {statistics.median(steps[m]) * 1e3:.0f} | {predicted[m]:.2f}x | {speedup[m]:.2f}x"
                f" ({', '.join(f'{x:.2f}' for x in per_round[m])}) | {(predicted[m] - speedup[m]) / speedup[m]:+.0%} |"
                for m in MODES
            )
            if advice:
                mode = next(m for m in MODES if f"communication_compression: {m}" in advice[0].argument)
                real = speedup[mode]
                verdict = (
                    f"Recommended `communication_compression: {mode}`, predicted **{advice[0].predicted_speedup:.2f}x**,"
                    f" measured **{real:.2f}x**: error **{(advice[0].predicted_speedup - real) / real:+.0%}** (target within"
                    f" 25%)."
                )
            else:
                verdict = "No compression recommended on the 1 Gbit/s link."
            sections.append(
                "### Simulated 1 Gbit/s cluster: predicted vs measured gain of each mode\n\n"
                f"{verdict}\n\nAdvice printed by the monitor:\n\n{advice_lines(profile)}\n\n"
                f"| mode | ms/step (median of {args.rounds} rounds) | predicted speed-up vs none | measured speed-up, median"
                " (rounds) | prediction error |\n"
                "|---|---|---|---|---|\n" + rows
            )

        plain, watched = [], []
        for _ in range(args.rounds):
            plain.append(median_after_warmup(run("none", "large", args.overhead_steps, workdir, None, args.batch)["times"], WARMUP))
            step, loopback = monitored(workdir, "loopback", args.overhead_steps, None, args.batch)
            watched.append(step)
        ratios = [w / p for w, p in zip(watched, plain)]
        overhead, spread = statistics.median(ratios) - 1, max(ratios) - min(ratios)
        resolvable = "" if spread <= 0.02 else f" (not resolvable here: the rounds spread over {spread:.1%}, the target is 2%)"
        compression_advised = any(a.rule == "compression" for a in advise(loopback))
        sections.append(
            "### Loopback: overhead and advice\n\n"
            f"Step time with the monitor / without, paired per round: {', '.join(f'{r:.3f}' for r in ratios)};"
            f" median overhead **{overhead:+.1%}**{resolvable} (target <= 2%). Compression recommended on loopback:"
            f" **{'yes' if compression_advised else 'no'}** (target: no).\n\nAdvice printed:\n\n{advice_lines(loopback)}"
        )

        _, slow = monitored(workdir, "straggler", args.steps, None, args.batch, straggler=True)
        named = [a.summary for a in advise(slow) if a.rule == "straggler"]
        sections.append(
            "### Loopback, rank 1 slowed 2x (`SlowRank(slowdown=2)`)\n\n"
            f"Straggler named correctly: **{'yes' if named and named[0].startswith('rank 1 ') else 'no'}**.\n\n"
            f"Advice printed:\n\n{advice_lines(slow)}"
        )

    write_section(
        "monitor",
        f"""
## CommunicationMonitor: advice checked against measurement

Command: `.venv/bin/python benchmarks/monitor.py --steps {args.steps} --rounds {args.rounds} --batch {args.batch} --overhead-steps {args.overhead_steps}` (model `large`,
2 processes, one per simulated node, gloo, 1 thread each, batch {args.batch} x 64 bytes per rank; median step time after {WARMUP} warm-up
steps; machine: {machine()}).

{chr(10).join(sections)}
""",
    )


if __name__ == "__main__":
    main()
