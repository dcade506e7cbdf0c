"""What the pack did in a run, in a few lines: the end of ``lightning-ciuic fit``.

Contract: :func:`run_summary(trainer, config)` reads only what survives in the launching process after ``fit``
(spawned workers keep their callbacks' state to themselves): the optimizer steps this ``fit`` trained (from the step
it resumed at: the strategy's ``fit_start_step``, handed back by its launcher), this run's ``monitor.json`` (report, trace, advice),
as :meth:`CommunicationMonitor.record_path` finds it (the file it wrote, or the one carrying its run id; never
another run's newer file in the same folder), the AsyncCheckpointer's store (its checkpoints, as
``lightning-ciuic checkpoint ls`` lists them), the metrics SnapshotRecovery logged (last snapshot, rollbacks), and
says how to resume. :func:`checkpoint_table` is the listing both use.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from lightning.pytorch import Trainer


def checkpoint_table(manifests: list[Any]) -> list[str]:
    lines = [f"{'name':32} {'step':>8} {'epoch':>6} {'size MB':>9} {'written MB':>11} {'ranks':>5}  created"]
    for m in manifests:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created))
        lines.append(f"{m.name:32} {m.step:8d} {m.epoch:6d} {m.logical_bytes / 1e6:9.2f} {m.written_bytes / 1e6:11.2f} {m.world_size:5d}  {created}")
    return lines


def _steps_trained(trainer: Trainer) -> tuple[int, int]:
    """(the step ``fit`` resumed at, the step it ended at); a launching process whose ranks were spawned has them
    from the strategy (its own loops never ran)."""
    start = getattr(trainer.strategy, "fit_start_step", None)
    end = getattr(trainer.strategy, "fit_end_step", None)
    return start or 0, end if end is not None else trainer.global_step


def run_summary(trainer: Trainer, config: Optional[str] = None) -> str:
    from lightning_ciuic.advice import RunProfile, advise
    from lightning_ciuic.callbacks.async_checkpoint import AsyncCheckpointer
    from lightning_ciuic.callbacks.monitor import CommunicationMonitor
    from lightning_ciuic.callbacks.recovery import SnapshotRecovery

    start, end = _steps_trained(trainer)
    lines = [f"Summary: {end - start} optimizer steps" + (f" (steps {start + 1} to {end})." if start else ".")]
    monitor = next((c for c in trainer.callbacks if isinstance(c, CommunicationMonitor)), None)
    if monitor is not None:
        found = monitor.record_path(trainer)
        if found is None:
            lines.append(f"- Communication report: none found for this run under {monitor.dirpath or trainer.default_root_dir}.")
        else:
            record = json.loads(found.read_text())
            folder = found.parent
            lines.append(f"- Communication report: {folder / 'report.html'}" + (f"; timeline (open in ui.perfetto.dev): {folder / 'trace.json'}" if record.get("trace") else ""))
            advice = advise(RunProfile.from_json(record["profile"]))
            lines += [f"- Advice: {a.summary}\n    change: {a.argument}" for a in advice] or ["- Advice: none (every rule checked; see the report)."]
    checkpointer = next((c for c in trainer.callbacks if isinstance(c, AsyncCheckpointer)), None)
    if checkpointer is not None:
        manifests = checkpointer.io.catalog.manifests()
        lines.append(f"- Checkpoints in {checkpointer.url} (lightning-ciuic checkpoint ls {checkpointer.url}):")
        lines += [f"    {line}" for line in checkpoint_table(manifests)]
    recovery = next((c for c in trainer.callbacks if isinstance(c, SnapshotRecovery)), None)
    if recovery is not None:
        metrics = trainer.callback_metrics
        last = metrics.get("recovery/snapshot_step")
        rollbacks = int(metrics["recovery/rollbacks"]) if "recovery/rollbacks" in metrics else 0
        lines.append(
            f"- Snapshots: every {recovery.snapshot_freq} steps, last at step {int(last) if last is not None else '-'};"
            f" {rollbacks} rollback(s) (a NaN or a loss spike rolls back to the last snapshot without a restart)."
        )
    if checkpointer is not None:
        source = f"--config {config} " if config else ""
        lines.append(f"- Resume: lightning-ciuic fit {source}--ckpt_path last   (from the newest intact checkpoint)")
    return "\n".join(lines)
