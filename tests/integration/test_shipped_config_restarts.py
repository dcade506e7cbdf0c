"""The shipped configs as a user runs them, killed and restarted: ``torchrun --max-restarts 1 lightning-ciuic fit
--config examples/configs/<name>.yaml``, a worker SIGKILLed mid-run, and the restarted workers resuming.

Each config is run as shipped but for what makes it short (steps, validation, where it writes) and the test's own
callbacks appended: a kill in one step of the first attempt, and a log of every step's loss per attempt. Exactness
needs no second run: the restarted attempt trains again the steps between its resume point and the kill, on the
same weights, optimizer state, learning rate and batch, so their losses must equal the first attempt's bit for bit
(a resume that misses the loader's position, the schedule or the optimizer state shows there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Callback

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
KILL_STEP = 4  # killed in optimizer step 4: the checkpoint (or snapshot) of step 2 is the last one written
EVERY = 2  # a checkpoint or a kept snapshot every 2 steps


class StepLosses(Callback):
    """Rank 0 appends ``{"attempt", "step", "loss"}`` for every optimizer step to ``path`` (JSON lines)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            with open(self.path, "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")


def _shortened(name: str, out: Path, steps: int) -> Path:
    """``examples/configs/<name>.yaml`` with ``steps`` steps, no validation, its files under ``out``, a checkpoint or a
    kept snapshot every 2 steps (the step-2 one is the last before the kill: a checkpoint waits until it is
    committed), and the kill and the loss log appended to its callbacks."""
    config = yaml.safe_load((REPO / "examples" / "configs" / f"{name}.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=steps, limit_train_batches=steps, limit_val_batches=0, log_every_n_steps=1)
    trainer.pop("val_check_interval", None)
    trainer["logger"]["init_args"]["save_dir"] = str(out / "logs")
    added = []
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("AsyncCheckpointer"):
            callback["init_args"].update(dirpath=str(out / "checkpoints"), every_n_train_steps=EVERY)
            added.append({"class_path": "tests.integration.restart_job.SavesCommittedBefore", "init_args": {"step": KILL_STEP}})
        if callback["class_path"].endswith("CommunicationMonitor"):
            callback["init_args"]["dirpath"] = str(out / "monitor")
        if callback["class_path"].endswith("SnapshotRecovery") and callback["init_args"].get("store") != "memory":
            callback["init_args"]["snapshot_freq"] = EVERY  # kept across a restart: the step-2 snapshot is the last
    trainer["callbacks"] += [
        *added,
        {"class_path": "lightning_ciuic.testing.FailAt", "init_args": {"step": KILL_STEP, "fault": "kill", "ranks": [1]}},
        {"class_path": f"{__name__}.StepLosses", "init_args": {"path": str(out / "losses.jsonl")}},
    ]
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _torchrun_fit(config: Path, out: Path) -> subprocess.CompletedProcess:
    cli = shutil.which("lightning-ciuic", path=str(Path(sys.executable).parent))
    assert cli is not None, "the project's console script is installed beside this Python"
    devices = yaml.safe_load(config.read_text())["trainer"]["devices"]
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={devices}", "--max-restarts=1",
        f"--master-port={free_port()}", "--no-python", cli, "fit", "--config", str(config),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=420)


@pytest.mark.parametrize("name", ["demo", "pipeline", "sharded", "experts", "hf_llama"])
def test_a_shipped_config_killed_mid_run_restarts_and_resumes_exactly(tmp_path, name):
    steps = KILL_STEP  # the restart trains step 3 again (compared with the first attempt's) and step 4
    result = _torchrun_fit(_shortened(name, tmp_path, steps), tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    records = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
    first = {r["step"]: r["loss"] for r in records if r["attempt"] == 0}
    second = {r["step"]: r["loss"] for r in records if r["attempt"] == 1}
    assert sorted(first) == list(range(1, KILL_STEP)), f"the first attempt was killed in step {KILL_STEP}"
    assert sorted(second) == list(range(EVERY + 1, steps + 1)), f"the restart resumed from step {EVERY}"
    assert [line for line in log.splitlines() if "SnapshotRecovery: resumed from " in line][:1], log[-4000:]
    assert {step: second[step] for step in first if step in second} == {step: first[step] for step in second if step in first}
