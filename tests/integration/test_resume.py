"""When SnapshotRecovery resumes at the start of ``fit`` (spawned ranks, HybridParallelStrategy): on a TorchElastic
restart or with ``resume="always"``, never on a fresh launch by itself, and never when ``fit`` was given a
``ckpt_path`` (Lightning loads that one, once). The leftover checkpoints come from one earlier run of the same job."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
from lightning.pytorch import Callback, Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic import HybridParallelStrategy
from lightning_ciuic.callbacks.async_checkpoint import AsyncCheckpointer
from lightning_ciuic.plugins.checkpoint_io import ChunkedCheckpointIO
from lightning_ciuic.summary import run_summary
from lightning_ciuic.callbacks.recovery import SnapshotRecovery
from lightning_ciuic.callbacks.lr_schedule import WarmupCosineSchedule
from lightning_ciuic.callbacks.monitor import CommunicationMonitor
from tests.helpers import TINY_MODEL, TokenWindows, lightning_epoch_order, loader

DP, PER_RANK_BATCH, FIRST_RUN_STEPS, NUM_SAMPLES = 2, 2, 4, 64  # 16 steps an epoch: step 4 is mid-epoch


class CountingStrategy(HybridParallelStrategy):
    """Counts ``load_checkpoint`` calls: Lightning's (``ckpt_path``) and SnapshotRecovery's go through it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loads: list[str] = []

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.loads.append(str(checkpoint_path))
        return super().load_checkpoint(checkpoint_path, weights_only)


class RunReport(Callback):
    """Rank 0 writes to ``path`` as JSON: the step training started at, the batches trained, the checkpoint loads
    and what SnapshotRecovery says it resumed from."""

    def __init__(self, path: Path) -> None:
        self.path, self.start_step, self.batches, self.samples = str(path), None, 0, []

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        self.samples.append(batch[0].tolist())

    def on_fit_end(self, trainer, pl_module):  # also when there was nothing left to train (no on_train_start)
        if trainer.is_global_zero:
            recovery = next(c for c in trainer.callbacks if isinstance(c, SnapshotRecovery))
            report = {
                "start_step": self.start_step, "end_step": trainer.global_step, "batches": self.batches,
                "loads": trainer.strategy.loads, "restored_from": recovery.restored_from, "samples": self.samples,
            }
            Path(self.path).write_text(json.dumps(report))


# The pack's callbacks that act at the start of fit, by name. WarmupCosineSchedule asks for
# trainer.estimated_stepping_batches in its on_fit_start, which makes Lightning set up the training loader there:
# before Lightning's own restore under HybridParallelStrategy, and before or after SnapshotRecovery's on_fit_start.
PACK_CALLBACKS = ("schedule", "recovery", "checkpointer", "monitor")


def _callbacks(order: tuple[str, ...], checkpoints: Path, first: bool, recovery: dict[str, Any]) -> list[Callback]:
    made = {
        "schedule": lambda: WarmupCosineSchedule(warmup_ratio=0.25),
        "recovery": lambda: SnapshotRecovery(snapshot_freq=100, store="memory", **recovery),
        "checkpointer": lambda: AsyncCheckpointer(
            str(checkpoints), save_interval=None, every_n_train_steps=2 if first else 3, save_on_train_end=first
        ),
        "monitor": lambda: CommunicationMonitor(str(checkpoints.parent / "monitor"), gather_every=2, profile_every=100, measure_link=False),
    }
    return [made[name]() for name in order]


def _fit(
    checkpoints: Path, report: Path, max_steps: int, ckpt_path: Optional[str] = None, first: bool = False,
    order: tuple[str, ...] = ("recovery", "checkpointer", "schedule"), **recovery: Any
) -> dict:
    """``first``: the earlier run, saving at steps 2 and 4; the others save every 3 steps (never under a name the
    earlier run used). ``order``: the pack's callbacks, by :data:`PACK_CALLBACKS` name, in the Trainer's order."""
    seed_everything(7)
    module = DeepSeekMini(**TINY_MODEL)
    trainer = Trainer(
        strategy=CountingStrategy(data_parallel_size=DP, start_method="forkserver"), accelerator="cpu", devices=DP,
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*_callbacks(order, checkpoints, first, recovery), RunReport(report)],
    )
    trainer.fit(module, loader(NUM_SAMPLES, PER_RANK_BATCH), ckpt_path=ckpt_path)
    return {**json.loads(report.read_text()), "summary": run_summary(trainer).splitlines()[0]}


def rank_zero_batches(first: int, count: int, epoch: int = 0) -> list[list[list[int]]]:
    """Rank 0's training batches ``first`` to ``first + count - 1`` of ``epoch``, as Lightning's DistributedSampler
    deals them: every DP-th sample of the epoch's order, from rank 0's place."""
    order = lightning_epoch_order(NUM_SAMPLES, epoch)[0::DP]
    inputs = TokenWindows(NUM_SAMPLES).data[:, :-1]
    return [inputs[order[i * PER_RANK_BATCH : (i + 1) * PER_RANK_BATCH]].tolist() for i in range(first, first + count)]


def _resume(resume: Optional[str]) -> dict[str, str]:
    return {} if resume is None else {"resume": resume}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """The checkpoint directory an earlier run of the job left behind: steps 2 and 4."""
    root = tmp_path_factory.mktemp("first_run")
    report = _fit(root / "checkpoints", root / "report.json", FIRST_RUN_STEPS, first=True)
    assert report["end_step"] == FIRST_RUN_STEPS and report["loads"] == []
    return root / "checkpoints"


@pytest.fixture
def leftover(first_run: Path, tmp_path: Path) -> Path:
    """A copy of the earlier run's checkpoints, for this test's run to find (and add to)."""
    return Path(shutil.copytree(first_run, tmp_path / "checkpoints"))


def test_a_fresh_launch_with_a_leftover_checkpoint_directory_starts_from_scratch(leftover, tmp_path, capfd):
    earlier = {path.relative_to(leftover): path.read_bytes() for path in (leftover / "checkpoints").rglob("*") if path.is_file()}
    report = _fit(leftover, tmp_path / "report.json", FIRST_RUN_STEPS, first=True)  # the same job again
    # Its step-2 save has the name of the earlier run's: versioned, nothing replaced
    names = [manifest.name for manifest in ChunkedCheckpointIO(str(leftover)).catalog.manifests()]
    assert "epoch=0-step=2" in names and "epoch=0-step=2-v1" in names, names
    assert all((leftover / path).read_bytes() == content for path, content in earlier.items())
    assert (report["start_step"], report["batches"], report["loads"]) == (0, FIRST_RUN_STEPS, [])
    assert report["restored_from"] is None
    output = capfd.readouterr()
    lines = [line for line in (output.out + output.err).splitlines() if "SnapshotRecovery: " in line and "from scratch" in line]
    assert len(lines) == 1, output.out + output.err
    assert str(leftover) in lines[0] and "step 4" in lines[0] and "ckpt_path" in lines[0] and "resume='always'" in lines[0]
    versioned = [line for line in (output.out + output.err).splitlines() if "saved as epoch=0-step=2-v1" in line]
    assert len(versioned) == 1 and "already holds a checkpoint epoch=0-step=2" in versioned[0]


@pytest.mark.parametrize(
    ("resume", "restart_count", "resumed"),
    [("always", None, True), (None, "1", True), ("never", "1", False)],  # None: the default ("restart")
    ids=["always-on-a-fresh-launch", "default-on-a-restart", "never-on-a-restart"],
)
def test_resume_argument_decides_whether_the_last_checkpoint_is_loaded(
    leftover, tmp_path, capfd, monkeypatch, resume, restart_count, resumed
):
    if restart_count is not None:  # the ranks' environment, as TorchElastic sets it for restarted workers
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
    report = _fit(leftover, tmp_path / "report.json", FIRST_RUN_STEPS + 2, **_resume(resume))
    output = capfd.readouterr()
    log = output.out + output.err
    if resumed:
        assert (report["start_step"], report["batches"]) == (FIRST_RUN_STEPS, 2)
        assert report["loads"] == [f"{leftover}/latest"] and report["restored_from"] == f"checkpoint {leftover}/latest"
        lines = [line for line in log.splitlines() if "SnapshotRecovery: resumed from " in line]
        assert len(lines) == 1 and f"checkpoint {leftover}/latest (step 4)" in lines[0], log
        assert ("(resume='always')" if resume == "always" else "(TorchElastic restart 1)") in lines[0]
    else:
        assert (report["start_step"], report["batches"], report["loads"]) == (0, FIRST_RUN_STEPS + 2, [])
        assert "SnapshotRecovery: resumed from " not in log
        assert "SnapshotRecovery: resume='never': training starts from scratch" in log


@pytest.mark.parametrize("order", list(itertools.permutations(PACK_CALLBACKS)), ids="-".join)
def test_a_restart_resumes_at_the_next_sample_whatever_the_order_of_the_callbacks(leftover, tmp_path, monkeypatch, order):
    """The resume decision and the loader's position hold for every order of the pack's callbacks: before the fix,
    WarmupCosineSchedule ahead of SnapshotRecovery set the loader up first and the restart trained from scratch."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    report = _fit(leftover, tmp_path / "report.json", FIRST_RUN_STEPS + 2, order=order)
    assert report["loads"] == [f"{leftover}/latest"], report["loads"]
    assert (report["start_step"], report["batches"]) == (FIRST_RUN_STEPS, 2)
    # the earlier run's last save, at its end, counts epoch 0 as finished (epoch=1-step=4): epoch 1 from its start
    assert report["samples"] == rank_zero_batches(0, 2, epoch=1), "the resumed run goes on at its next batch"


@pytest.mark.parametrize("schedule_first", [True, False], ids=["schedule-first", "recovery-first"])
@pytest.mark.parametrize(
    ("resume", "restart_count"),
    [(None, None), (None, "1"), ("always", None), ("never", None)],
    ids=["fresh-launch", "restart", "resume-always", "resume-never"],
)
def test_ckpt_path_is_the_only_checkpoint_loaded(leftover, tmp_path, monkeypatch, resume, restart_count, schedule_first):
    """Once, and at its position in the epoch (Lightning set the loader up before restoring: issue #20550)."""
    if restart_count is not None:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
    older = str(leftover / "epoch=0-step=2")  # not the newest (step 4), which the callback would load
    order = ("schedule", "recovery", "checkpointer") if schedule_first else ("recovery", "schedule", "checkpointer")
    report = _fit(leftover, tmp_path / "report.json", FIRST_RUN_STEPS, ckpt_path=older, order=order, **_resume(resume))
    assert report["loads"] == [older], report
    assert (report["start_step"], report["batches"]) == (2, 2) and report["restored_from"] is None
    assert report["samples"] == rank_zero_batches(2, 2)
    assert report["summary"] == "Summary: 2 optimizer steps (steps 3 to 4).", "counted in the launching process"


def test_resume_must_be_one_of_the_choices():
    with pytest.raises(ValueError, match="resume='yes' is not one of 'restart', 'always', 'never'"):
        SnapshotRecovery(resume="yes")


def test_resume_is_set_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  callbacks:\n    - class_path: lightning_ciuic.SnapshotRecovery\n"
        "      init_args: {snapshot_freq: 50, store: memory, resume: always}\n"
        "model:\n  class_path: examples.deepseek.DeepSeekMini\n  init_args: {dim: 32}\n"
        "data:\n  class_path: examples.data.ByteCorpusDataModule\n"
    )
    cli = LightningCLI(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
        args=["--config", str(config)],
    )
    (recovery,) = [c for c in cli.trainer.callbacks if isinstance(c, SnapshotRecovery)]
    assert recovery.resume == "always"
