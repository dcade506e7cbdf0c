"""Restart after ``kill -9``: SnapshotRecovery against a ``ckpt_path="last"`` restart from checkpoints in an object store.

Users keep checkpoints in object stores, not in the page cache of the training machine. A simulated 2-node cluster
(``benchmarks/sim_cluster.py``; needs root): node 0 runs the training job (``torchrun --nproc-per-node=2
--max-restarts=1``, ``HybridParallelStrategy`` dp=2, the ``--model`` DeepSeek-style model with AdamW: ``xxl`` is
91.8M parameters, 1.1 GB of state per replica), node 1 runs an S3-compatible server (moto); the link between them is
capped at ``--rate``. State is saved every ``--every`` steps by

* ``snapshot``: ``SnapshotRecovery(store="shm")`` (each rank's state in this node's shared memory);
* ``checkpoint_s3``: ``AsyncCheckpointer("s3://...", every_n_train_steps=--every)`` (the pack's incremental,
  zstd-compressed chunks, written in the background) and ``fit(ckpt_path="last")``, as a user would run it.

Rank 1 is killed with SIGKILL in step ``--fault-step``; the restarted attempt is measured with the parts
``benchmarks/recovery.py`` names (restart, imports, set-up, restore, first step), and for the S3 runs when each
checkpoint committed relative to the fault (a background save that has not committed by then is lost: the restart
takes the one before). ``--rounds`` interleaved rounds, means; the ratios over the rounds that restored an S3
checkpoint. Writes the ``recovery_s3`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/recovery_s3.py [--model xxl] [--every 10] [--fault-step 28] [--steps 29] [--rounds 2] [--rate 1gbit]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import describe, machine, write_section  # noqa: E402
from benchmarks.recovery import MODELS, S3_OPTIONS, part_labels, restart_timeline, run  # noqa: E402
from benchmarks.sim_cluster import SimulatedCluster, available  # noqa: E402
from examples.deepseek import DeepSeekMini  # noqa: E402

PORT, BUCKET = 5077, "ciuic-bench"
METHODS = {"snapshot": "SnapshotRecovery (node 0's shared memory)", "checkpoint_s3": "AsyncCheckpointer on S3 + `fit(ckpt_path=\"last\")`"}


def in_node(cluster: SimulatedCluster, node: int, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", cluster.namespace(node), *argv]


def start_object_store(cluster: SimulatedCluster) -> tuple[subprocess.Popen, dict]:
    """moto's S3 server on node 1, reachable from node 0 through the capped link; its fsspec options."""
    host = cluster.address(1)
    server = subprocess.Popen(in_node(cluster, 1, sys.executable, "-m", "moto.server", "-H", host, "-p", str(PORT)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": f"http://{host}:{PORT}"}}
    make_bucket = f"import s3fs; s3fs.S3FileSystem(**{options!r}).mkdir({BUCKET!r})"
    for _ in range(60):  # the server takes a few seconds to import and listen
        if subprocess.run(in_node(cluster, 0, sys.executable, "-c", make_bucket), capture_output=True).returncode == 0:
            return server, options
        time.sleep(1)
    server.kill()
    raise RuntimeError(f"the S3 server on {host}:{PORT} did not come up")


def committed(cluster: SimulatedCluster, options: dict, url: str) -> list[tuple[int, float]]:
    """(step, commit time) of every checkpoint committed under ``url``, as node 0 sees the store."""
    code = (
        "import json; from lightning_ciuic.checkpoint.incremental import CheckpointCatalog, ChunkStore;"
        " from lightning_ciuic.checkpoint.storage import Storage;"
        f" print(json.dumps([(m.step, m.created) for m in CheckpointCatalog(ChunkStore(Storage({url!r}, {options!r}))).manifests()]))"
    )
    out = subprocess.run(in_node(cluster, 0, sys.executable, "-c", code), capture_output=True, text=True, check=True)
    return [tuple(pair) for pair in json.loads(out.stdout.strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="xxl", choices=sorted(MODELS))
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fault-step", type=int, default=28)
    parser.add_argument("--steps", type=int, default=29)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", default="1gbit")
    args = parser.parse_args()
    reason = available()
    if reason:
        raise SystemExit(f"benchmarks/recovery_s3.py {reason}")
    timelines: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    landed: list[list[str]] = []  # per S3 run: each committed checkpoint's step and when it committed
    with tempfile.TemporaryDirectory() as tmp, SimulatedCluster(nodes=2, rate=args.rate) as cluster:
        for round_ in range(args.rounds):
            for method in METHODS:  # interleaved: the machine's drift hits both alike
                env, server, url = {}, None, f"{tmp}/{method}-{round_}"
                if method == "checkpoint_s3":  # a fresh server per run: moto keeps every object in memory
                    server, options = start_object_store(cluster)
                    env, url = {S3_OPTIONS: json.dumps(options)}, f"s3://{BUCKET}/run-{round_}"
                try:
                    records, fault_at = run(args, method, "kill", args.steps, url, prefix=tuple(in_node(cluster, 0)), env=env)
                    timelines[method].append(restart_timeline(records, fault_at, args.fault_step))
                    if server is not None:
                        landed.append([f"step {step}: {created - fault_at:+.0f} s" for step, created in committed(cluster, options, url)])
                finally:
                    if server is not None:
                        server.kill()
                        server.wait()
                print(method, timelines[method][-1], landed[-1:] if server else "", flush=True)

    restored = [i for i, t in enumerate(timelines["checkpoint_s3"]) if t["steps_lost"] < args.fault_step - 1]

    def mean(method: str, key: str) -> str:
        values = [t[key] for t in timelines[method]]
        return f"{statistics.fmean(values):.2f} s ({', '.join(f'{v:.2f}' for v in values)})"

    rows = [f"| {label} | {' | '.join(mean(m, key) for m in METHODS)} |" for key, label in part_labels(args.fault_step).items()]
    lost = {m: [t["steps_lost"] for t in timelines[m]] for m in METHODS}

    def ratio(key: str) -> str:
        values = [timelines["snapshot"][i][key] / timelines["checkpoint_s3"][i][key] for i in restored]
        if not values:
            return "no round restored an S3 checkpoint"
        return f"**{statistics.fmean(values):.0%}** (rounds that restored a checkpoint: {', '.join(f'{v:.0%}' for v in values)})"

    model = describe(DeepSeekMini(**MODELS[args.model]), args.model)
    state_gb = sum(p.numel() for p in DeepSeekMini(**MODELS[args.model]).parameters()) * 12 / 1e9
    write_section(
        "recovery_s3",
        f"""
## Restart after `kill -9`: SnapshotRecovery against checkpoints in an object store behind a {args.rate} link

Command: `.venv/bin/python benchmarks/recovery_s3.py --model {args.model} --every {args.every} --fault-step {args.fault_step} --steps {args.steps} --rounds {args.rounds} --rate {args.rate}`
(simulated 2-node cluster: node 0 runs `torchrun --nproc-per-node=2 --max-restarts=1`, HybridParallelStrategy dp=2,
{model} + AdamW, the state of each replica {state_gb:.2f} GB (weights and two moments); node 1 runs moto's S3 server
(a fresh one per run); the link between them capped at {args.rate} each way; state saved every {args.every} steps by
both; rank 1 killed in step {args.fault_step}; means of {args.rounds} interleaved rounds, each round's in brackets;
machine: {machine()}).

| part | {' | '.join(METHODS.values())} |
|---|---|---|
""" + "\n".join(rows) + f"""

| measure | result |
|---|---|
| fault -> training again: snapshot / S3 checkpoint | {ratio('to_training')} (seed: an 80% cut, i.e. 20%) |
| the restore alone: snapshot / S3 checkpoint | {ratio('restore')} |
| steps lost (steps of the failed attempt the restored state does not hold), per round | snapshot {lost['snapshot']}, S3 checkpoint {lost['checkpoint_s3']} ({args.fault_step - 1}: nothing restored) |
| S3 checkpoints committed, per run (relative to the fault) | {'; '.join(', '.join(run) or 'none' for run in landed)} |
""",
    )


if __name__ == "__main__":
    main()
