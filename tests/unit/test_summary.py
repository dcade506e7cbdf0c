"""The summary at the end of ``fit`` names this run's report, with another run's newer ``monitor.json`` under the
same folder: in the process that trained (the monitor knows where it wrote), and in a launching process whose ranks
were spawned (its copy of the monitor finds the file its ranks wrote, by the run's id)."""

import copy
import json
import os
import re
from types import SimpleNamespace

from lightning.pytorch import Trainer, seed_everything

from examples.deepseek import DeepSeekMini
from lightning_ciuic import CommunicationMonitor
from lightning_ciuic.summary import run_summary
from tests.helpers import TINY_MODEL, loader


def _report_line(summary):
    return next(line for line in summary.splitlines() if line.startswith("- Communication report: "))


def test_the_summary_names_this_runs_report_not_the_newest(tmp_path):
    seed_everything(7)
    monitor = CommunicationMonitor(measure_link=False, trace=True)
    launching = copy.deepcopy(monitor)  # what a launching process keeps when the ranks get pickled copies
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=[monitor])
    trainer.fit(DeepSeekMini(**TINY_MODEL), loader(12, 4))
    ours = tmp_path / "monitor" / "monitor.json"
    assert ours.is_file()

    other = tmp_path / "lightning_logs" / "version_9" / "monitor"  # another run, later, in the same folder
    other.mkdir(parents=True)
    (other / "monitor.json").write_text(json.dumps({**json.loads(ours.read_text()), "run_id": "another run"}))
    os.utime(other / "monitor.json", (ours.stat().st_mtime + 60, ours.stat().st_mtime + 60))

    expected = f"- Communication report: {ours.parent / 'report.html'}; timeline (open in ui.perfetto.dev): {ours.parent / 'trace.json'}"
    assert _report_line(run_summary(trainer)) == expected

    spawned = SimpleNamespace(
        global_step=3, callbacks=[launching], default_root_dir=str(tmp_path), loggers=[], callback_metrics={},
        strategy=SimpleNamespace(fit_start_step=0),
    )
    assert _report_line(run_summary(spawned)) == expected

    ours.unlink()  # this run's report gone: the other run's is not offered instead
    line = _report_line(run_summary(spawned))
    assert "version_9" not in line and re.search(r"none found for this run under .*" + re.escape(str(tmp_path)), line), line


def test_the_summary_counts_the_steps_this_fit_trained():
    resumed = SimpleNamespace(global_step=8, callbacks=[], strategy=SimpleNamespace(fit_start_step=5))
    assert run_summary(resumed).splitlines()[0] == "Summary: 3 optimizer steps (steps 6 to 8)."
    fresh = SimpleNamespace(global_step=8, callbacks=[], strategy=SimpleNamespace(fit_start_step=0))
    assert run_summary(fresh).splitlines()[0] == "Summary: 8 optimizer steps."
