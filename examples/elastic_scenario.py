"""Lose a node and bring it back: the elastic scenario that ``tests/integration/test_elastic.py`` asserts on and
``benchmarks/elastic.py`` measures.

Two ``torchrun --nnodes=1:2 --nproc-per-node=1`` (or more) agents (c10d rendezvous) on this machine run
``examples/elastic.py``, each agent standing for a node. In the middle of the run one agent and its worker are
killed with SIGKILL (a lost node); the other must go on alone; then the killed agent is started again and the run
must return to two nodes. An uninterrupted run (one agent, two ranks) on the same data is the reference.
:func:`run_scenario` returns the time from the kill to the first training step on one node, steps lost, time from
the rejoin to the first step on two nodes, steps lost there, the final held-out loss against the reference, the
samples of each optimizer step and Lightning's position (epoch, batch) of the updates the run kept, and what each restart resumed from.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from lightning_ciuic.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

JOB = ROOT / "examples" / "elastic.py"
RDZV_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def agent(
    out: Path, port: int, steps: int, step_seconds: float, nnodes: str = "1:2", nproc: int = 1, job_args: tuple[str, ...] = (),
    run_id: str = "ciuic-elastic",
) -> subprocess.Popen:
    """Start one torchrun agent (a node) running the elastic example (with ``job_args``) in the run ``run_id`` (its
    shared-memory snapshots are named after it); its output goes to ``out/agent-*.log``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
        "--max-restarts=3", "--monitor-interval=0.5", f"--rdzv-conf={RDZV_CONF}",
        str(JOB), str(out), "--steps", str(steps), "--step-seconds", str(step_seconds), *job_args,
    ]
    # TorchElastic's shared rendezvous store breaks a rejoining node (pytorch#135712): see docs/elastic.md.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    log = open(out / f"agent-{time.time_ns()}.log", "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _is_reaper(pid: int) -> bool:
    try:
        return b"lightning-ciuic-snapshot-reaper" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def lose_node(process: subprocess.Popen) -> None:
    """SIGKILL an agent and every process under it (TorchElastic's workers run in sessions of their own). The
    snapshot reapers are spared: on one machine they stand for the lost node's memory going with it (they delete the
    node's snapshots once its agent is gone)."""
    for pid in [process.pid, *(p for p in _descendants(process.pid) if not _is_reaper(p))]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def progress(out: Path) -> list[dict]:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def kept_records(records: list[dict], restart_gap_s: float = 2.0) -> list[dict]:
    """The records that ended an optimizer step in the run that made its update last (a restart trains again the
    steps since its snapshot, seconds later: the records of a step's last training lie within ``restart_gap_s`` of
    its newest)."""
    stepped = [record for record in records if record.get("samples") is not None]  # records that ended their step
    newest: dict[int, float] = {}
    for record in stepped:
        newest[record["step"]] = max(newest.get(record["step"], 0.0), record["time"])
    return [record for record in stepped if record["time"] >= newest[record["step"]] - restart_gap_s]


def final_trajectory(records: list[dict], restart_gap_s: float = 2.0) -> dict[int, list[str]]:
    """For each step, the samples of the run that made its update last (:func:`kept_records`)."""
    samples: dict[int, list[str]] = {}
    for record in kept_records(records, restart_gap_s):
        samples.setdefault(record["step"], []).extend(record["samples"])
    return {step: sorted(found) for step, found in sorted(samples.items())}


def logs(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("agent-*.log")))


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def run_scenario(
    workdir: Path, steps: int = 60, step_seconds: float = 0.2, kill_at: int = 15, alone_steps: int = 10,
    job_args: tuple[str, ...] = (), nproc_per_node: int = 1, reference: bool = True, reference_alongside: bool = False,
) -> dict:
    """Reference run (``reference=False``: none, and no loss compared), then the lose-and-rejoin run (``job_args``
    passed to examples/elastic.py, e.g. ``("--sharded",)``; ``nproc_per_node`` processes per node, the reference on
    one node of twice as many); returns the measurements (see the module docstring).

    ``reference_alongside``: the lose-and-rejoin run starts once the reference has taken its first step (its
    processes started and imported, the rest of it mostly the job's sleeps) instead of after it ends: the tests'
    time, not the benchmark's (its timings would share the cores with the reference's steps)."""
    reference_dir, out = workdir / "reference", workdir / "elastic"
    reference_dir.mkdir(parents=True)
    out.mkdir(parents=True)
    if reference:
        uninterrupted = agent(  # a run of its own: its snapshots are not among those of the run checked for leftovers
            reference_dir, free_port(), steps, step_seconds, nnodes="1", nproc=2 * nproc_per_node, job_args=job_args,
            run_id="ciuic-reference",
        )
        if reference_alongside:
            wait_for(lambda: uninterrupted.poll() is not None or any(r["step"] >= 1 for r in progress(reference_dir)),
                     300, "the reference's first step")
        if (not reference_alongside or uninterrupted.poll() is not None) and uninterrupted.wait(timeout=600) != 0:
            raise RuntimeError(f"reference run failed:\n{logs(reference_dir)}")

    both, one = 2 * nproc_per_node, nproc_per_node  # world sizes on two nodes and on one
    shm_before = set(Path("/dev/shm").glob("lightning_ciuic-ciuic-elastic-*"))
    port = free_port()
    first = agent(out, port, steps, step_seconds, nproc=nproc_per_node, job_args=job_args)
    time.sleep(1.0)  # the first agent hosts the rendezvous store: it is the one that stays
    second = agent(out, port, steps, step_seconds, nproc=nproc_per_node, job_args=job_args)
    try:
        wait_for(lambda: any(r["world"] == both and r["step"] >= kill_at for r in progress(out)), 300, f"two nodes at step {kill_at}")
        lose_node(second)
        killed_at = time.time()
        before_kill = max(r["step"] for r in progress(out) if r["time"] < killed_at)
        wait_for(lambda: any(r["world"] == one and r["time"] > killed_at for r in progress(out)), 120, "one node going on")
        alone = [r for r in progress(out) if r["world"] == one and r["time"] > killed_at]
        resumed = min(r["step"] for r in alone)
        wait_for(lambda: max(r["step"] for r in progress(out)) >= resumed + alone_steps, 120, "steps on one node")
        rejoined_at = time.time()
        second = agent(out, port, steps, step_seconds, nproc=nproc_per_node, job_args=job_args)
        wait_for(lambda: any(r["world"] == both and r["time"] > rejoined_at for r in progress(out)), 180, "two nodes again")
        before_rejoin = max(r["step"] for r in progress(out) if r["world"] == one)
        back = [r for r in progress(out) if r["world"] == both and r["time"] > rejoined_at]
        if first.wait(timeout=600) != 0 or second.wait(timeout=120) != 0:
            raise RuntimeError(f"elastic run failed:\n{logs(out)}")
        if reference and uninterrupted.wait(timeout=600) != 0:
            raise RuntimeError(f"reference run failed:\n{logs(reference_dir)}")
    finally:
        for process in (first, second, *([uninterrupted] if reference else [])):
            if process.poll() is None:
                lose_node(process)
    leftover: list[Path] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # every agent has exited: their reapers release the shared memory
        leftover = sorted(set(Path("/dev/shm").glob("lightning_ciuic-ciuic-elastic-*")) - shm_before)
        if not leftover:
            break
        time.sleep(0.2)
    final = json.loads((out / "final.json").read_text())
    expected = json.loads((reference_dir / "final.json").read_text()) if reference else None
    return {
        "to_one_node_s": min(r["time"] for r in alone) - killed_at,
        "lost_on_kill": before_kill - resumed + 1,
        "accumulate_alone": sorted({r["accumulate"] for r in alone}),
        "to_two_nodes_s": min(r["time"] for r in back) - rejoined_at,
        "lost_on_rejoin": before_rejoin - min(r["step"] for r in back) + 1,
        "final": final,
        "reference": expected,
        "loss_difference": abs(final["loss"] - expected["loss"]) / expected["loss"] if expected else None,
        "samples_by_step": final_trajectory(progress(out)),
        "positions_kept": sorted({  # where Lightning counted each kept update: (step, world, epoch, batch index)
            (r["step"], r["world"], r.get("epoch"), r.get("batch")) for r in kept_records(progress(out))
        }),
        "decisions": [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()],
        "shared_memory_left": [str(p) for p in leftover],
        "layouts": sorted({  # each start's layout, as HybridParallelStrategy printed it
            line.split("HybridParallelStrategy: ", 1)[1].split(", backend")[0]
            for log in sorted(out.glob("agent-*.log")) for line in log.read_text().splitlines()
            if "HybridParallelStrategy: " in line
        }),
        "resumed_from": [  # what each restart restored, as SnapshotRecovery reported it
            line.split("resumed from ", 1)[1].split(" in ")[0]
            for log in sorted(out.glob("agent-*.log")) for line in log.read_text().splitlines()
            if "SnapshotRecovery: resumed from " in line
        ],
    }
