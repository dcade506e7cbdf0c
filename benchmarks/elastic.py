"""Elastic nodes on TorchElastic, measured: lose a node, go on with one, get it back.

Two ``torchrun --nnodes=1:2 --nproc-per-node=1`` agents (c10d rendezvous) on this machine run
``examples/elastic.py``, each agent standing for a node. In the middle of the run one agent and its worker are
killed with SIGKILL (a lost node); the other must go on alone; then the killed agent is started again and the run
must return to two nodes. An uninterrupted run (one agent, two ranks) on the same data is the reference.

Measured: time from the kill to the first training step on one node, steps lost, time from the rejoin to the first
step on two nodes, steps lost there, and the final held-out loss against the reference. ``tests/integration/
test_elastic.py`` runs the same scenario (``examples/elastic_scenario.py``) and asserts the targets. Writes the ``elastic``
section of docs/benchmarks.md.

    .venv/bin/python benchmarks/elastic.py [--steps 60] [--step-seconds 0.2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, write_section  # noqa: E402
from examples.elastic_scenario import run_scenario  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run_scenario(Path(tmp), args.steps, args.step_seconds))

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in results)

    worst_loss = max(r["loss_difference"] for r in results)
    write_section(
        "elastic",
        f"""
## ElasticResourceManager: lose a node, go on, rejoin (two torchrun agents)

Command: `.venv/bin/python benchmarks/elastic.py --steps {args.steps} --step-seconds {args.step_seconds} --rounds {args.rounds}`
(two `torchrun --nnodes=1:2 --nproc-per-node=1` agents, c10d rendezvous with 1 s keep-alive and last call,
`--monitor-interval=0.5`, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`; `examples/elastic.py`: tiny model, global batch 8,
`SnapshotRecovery(snapshot_freq=5)`; one agent killed with SIGKILL (agent and worker) at step 15, started again
10 steps later; means of {args.rounds} rounds; machine: {machine()}).

| measure | result |
|---|---|
| kill -> first training step on the remaining node | **{mean('to_one_node_s'):.1f} s** (target <= 60 s) |
| steps lost to the kill | {', '.join(str(r['lost_on_kill']) for r in results)} (at most `snapshot_freq` = 5) |
| accumulation on one node (global batch kept at 8) | {results[0]['accumulate_alone']} |
| rejoin -> first training step on two nodes | {mean('to_two_nodes_s'):.1f} s |
| steps lost to the rejoin (TorchElastic stops the workers with SIGTERM: snapshot, then leave) | {', '.join(str(r['lost_on_rejoin']) for r in results)} |
| final held-out loss vs an uninterrupted run on the same data | {results[0]['final']['loss']:.5f} vs {results[0]['reference']['loss']:.5f}: worst difference **{worst_loss:.2e}** relative (target <= 2%) |
| scale decisions written | {sum(len(r['decisions']) for r in results)} ({', '.join(sorted({d['action'] for r in results for d in r['decisions']}))}) |
""",
    )


if __name__ == "__main__":
    main()
