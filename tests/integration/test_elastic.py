"""Real elastic training: two TorchElastic agents (`torchrun --nnodes=1:2`, c10d rendezvous) on this machine; one
is killed mid-run (agent and worker, as when a node is lost), the other continues alone, the killed one is started
again and the run returns to two nodes, ending at the loss of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "integration" / "elastic_job.py"
STEPS = 60


def _agent(out: Path, port: int, nnodes: str = "1:2", nproc: int = 1) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ciuic-elastic-test",
        "--max-restarts=3", "--monitor-interval=0.5",
        "--rdzv-conf=join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
        str(JOB), str(out), "--steps", str(STEPS),
    ]
    # TorchElastic's shared rendezvous store breaks a rejoining node (pytorch#135712); docs/elastic.md says the same.
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
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


def _lose_node(agent: subprocess.Popen) -> None:
    """SIGKILL the agent and every process under it (TorchElastic's workers run in sessions of their own)."""
    for pid in [agent.pid, *_descendants(agent.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _progress(out: Path) -> list[dict]:
    path = out / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def _logs(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("agent-*.log")))


def test_losing_a_node_continues_on_one_and_a_rejoining_node_brings_the_run_back_to_two(tmp_path):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference = _agent(reference_dir, free_port(), nnodes="1", nproc=2)  # uninterrupted: 2 ranks throughout
    assert reference.wait(timeout=300) == 0, _logs(reference_dir)

    out = tmp_path / "elastic"
    out.mkdir()
    port = free_port()
    first = _agent(out, port)
    time.sleep(1.0)  # the first agent hosts the rendezvous store
    second = _agent(out, port)
    try:
        _wait_for(lambda: any(r["world"] == 2 and r["step"] >= 15 for r in _progress(out)), 180, "two nodes at step 15")
        _lose_node(second)  # the node is gone: agent and worker
        killed_at = time.time()
        _wait_for(lambda: any(r["world"] == 1 and r["time"] > killed_at for r in _progress(out)), 90, "one node going on")
        alone = min(r["time"] for r in _progress(out) if r["world"] == 1 and r["time"] > killed_at)
        assert alone - killed_at < 60, f"the surviving node took {alone - killed_at:.1f} s to train again"
        resumed_step = min(r["step"] for r in _progress(out) if r["world"] == 1)
        lost = max(r["step"] for r in _progress(out) if r["time"] < killed_at) - resumed_step + 1
        assert lost <= 5, f"{lost} steps lost; at most snapshot_freq=5"
        assert all(r["accumulate"] == 2 for r in _progress(out) if r["world"] == 1)  # global batch kept

        _wait_for(lambda: max(r["step"] for r in _progress(out)) >= resumed_step + 10, 60, "ten steps alone")
        rejoined_at = time.time()
        second = _agent(out, port)
        _wait_for(lambda: any(r["world"] == 2 and r["time"] > rejoined_at for r in _progress(out)), 120, "two nodes again")
        assert first.wait(timeout=300) == 0, _logs(out)
        assert second.wait(timeout=60) == 0, _logs(out)
    finally:
        for agent in (first, second):
            if agent.poll() is None:
                _lose_node(agent)

    final, expected = json.loads((out / "final.json").read_text()), json.loads((reference_dir / "final.json").read_text())
    assert final["step"] == STEPS and final["world"] == 2
    assert final["loss"] == pytest.approx(expected["loss"], rel=0.02)
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    assert decisions and all(d["action"] in ("scale_up", "scale_down", "hold") for d in decisions)
