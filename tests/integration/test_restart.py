"""Real restarts: `torchrun --max-restarts` on CPU, a worker killed with SIGKILL mid-run, and the restarted workers
resuming from snapshots (or the last checkpoint) to end exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_state_equal, free_port

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "integration" / "restart_job.py"


def _torchrun(out: Path, *args: str, max_restarts: int = 1) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--max-restarts={max_restarts}",
        f"--master-port={free_port()}", str(JOB), str(out), *args,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _report(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _wait_gone(path: Path, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not path.exists()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = _torchrun(out, max_restarts=0)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / "final.pt")


@pytest.mark.parametrize(
    ("store", "extra", "source"),
    [
        ("shm", (), "the step-4 snapshot (shm, this node's memory)"),
        ("peer", ("--lose-snapshots",), "the step-4 snapshot (shm, a peer's copy)"),
    ],
    ids=["shared-memory", "peer-after-losing-local-snapshots"],
)
def test_killed_worker_restarts_from_snapshot_and_ends_like_an_uninterrupted_run(tmp_path, uninterrupted, store, extra, source):
    # Snapshots every 4 steps; rank 1 is killed (SIGKILL) in step 7 of 12; torchrun restarts both workers.
    result = _torchrun(tmp_path, "--store", store, "--fault", "kill", "--fault-step", "7", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FailAt: rank 1, step 7: kill" in result.stdout + result.stderr
    reports = _report(tmp_path)
    assert [r["attempt"] for r in reports] == [1, 1]
    assert [r["restored_from"] for r in reports] == [source, source]
    assert_state_equal(torch.load(tmp_path / "final.pt"), uninterrupted)
    assert _wait_gone(Path(reports[0]["run_directory"])), "shared memory left behind after the run"


def test_a_sharded_run_killed_mid_run_restarts_from_its_shards_snapshots_and_ends_like_an_uninterrupted_one(tmp_path):
    """FSDP over both ranks: each rank's snapshot is its shard; the restarted workers (same layout) take their own."""
    reference = tmp_path / "reference"
    result = _torchrun(reference, "--sharded", max_restarts=0)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "killed"
    result = _torchrun(run, "--sharded", "--store", "shm", "--fault", "kill", "--fault-step", "7")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = _report(run)
    assert [r["restored_from"] for r in reports] == ["the step-4 snapshot (shm, this node's memory)"] * 2
    assert_state_equal(torch.load(run / "final.pt"), torch.load(reference / "final.pt"))


def test_without_snapshots_the_restart_resumes_from_the_last_async_checkpoint(tmp_path, uninterrupted):
    checkpoints = tmp_path / "checkpoints"
    result = _torchrun(
        tmp_path, "--store", "memory", "--checkpoint-dir", str(checkpoints), "--fault", "kill", "--fault-step", "11"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = _report(tmp_path)
    assert all(r["restored_from"] == f"checkpoint {checkpoints}/latest" for r in reports), reports
    assert_state_equal(torch.load(tmp_path / "final.pt"), uninterrupted)


def test_shared_memory_is_released_when_the_run_fails_for_good(tmp_path):
    shm_root = tmp_path / "shm"
    result = _torchrun(tmp_path, "--shm-root", str(shm_root), "--fault", "kill", "--fault-step", "7", max_restarts=0)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "FailAt: rank 1, step 7: kill" in output
    run = Path(output.split("SnapshotRecovery: shm snapshots in ")[1].split()[0])
    assert run.parent == shm_root
    assert _wait_gone(run), f"left behind: {list(run.rglob('*'))}"
