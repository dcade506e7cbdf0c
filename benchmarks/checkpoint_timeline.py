"""Where an async save slows training: each step's period beside the background writes, on one clock.

One process trains ``benchmarks/checkpoint.py``'s model (1.0 GB of state, two intra-op threads) for ``--steps`` steps
with ``AsyncCheckpointer`` saving every ``--every`` steps to a local directory (``--dir``), the writer at nice 19 as
shipped or at nice 0 (``--writer-nice 0``). The writes' spans come from :data:`lightning_ciuic.timeline.timeline`
(the writer records each), the steps' periods from ``benchmarks.checkpoint.StepTimes``. For each save: how long its
write ran, the steps that overlapped it (their periods against the median period of the steps that overlapped
none and did not stage one), and the two steps after it. Writes the ``checkpoint_timeline`` section (or
``--section``) of docs/benchmarks.md.

    .venv/bin/python benchmarks/checkpoint_timeline.py [--steps 42] [--every 10] [--writer-nice 19] [--dir PATH]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import lightning_ciuic.plugins.checkpoint_io as checkpoint_io  # noqa: E402
from benchmarks.checkpoint import StepTimes, fit  # noqa: E402
from benchmarks.common import machine, write_section  # noqa: E402
from lightning_ciuic import AsyncCheckpointer  # noqa: E402
from lightning_ciuic.timeline import timeline  # noqa: E402


class StepStarts(StepTimes):
    """``StepTimes`` that also keeps when each step started."""

    def __init__(self, io=None) -> None:
        super().__init__(io)
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=42)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--writer-nice", type=int, default=19, choices=[0, 19])
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parents[1]), help="where the checkpoints go")
    parser.add_argument("--section", default="checkpoint_timeline")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.writer_nice == 0:
        checkpoint_io._lowest_priority = lambda: None  # the executor's initializer, looked up when it starts
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        callback = AsyncCheckpointer(f"{tmp}/ckpt", save_interval=None, every_n_train_steps=args.every, save_on_train_end=False)
        timer = StepStarts(callback.io)
        began = time.perf_counter()
        fit([callback], args.steps, io=callback.io, timer=timer)
    ends = [start + period for start, period in zip(timer.starts, timer.periods)]
    writes = [s for s in timeline.ending_within(began, time.perf_counter()) if s.name == "checkpoint write"]
    overlapping = [[i for i, (s, e) in enumerate(zip(timer.starts, ends)) if s < w.end and e > w.start] for w in writes]
    staging = {steps[0] - 1 for steps in overlapping if steps}  # a save is staged in the step before its write starts
    quiet = [p for i, p in enumerate(timer.periods) if i > 2 and i not in staging and not any(i in o for o in overlapping)]
    base = statistics.median(quiet)
    rows = []
    for k, (write, steps) in enumerate(zip(writes, overlapping)):
        after = [i for i in range(steps[-1] + 1, steps[-1] + 3) if i < len(timer.periods)] if steps else []
        during = ", ".join(f"{timer.periods[i] / base:.2f}" for i in steps)
        rows.append(
            f"| {k + 1} | {write.end - write.start:.2f} | {len(steps)} | {during} |"
            f" {', '.join(f'{timer.periods[i] / base:.2f}' for i in after)} |"
        )
    command = shlex.join([".venv/bin/python", "benchmarks/checkpoint_timeline.py", *sys.argv[1:]])
    write_section(args.section, f"""## Where an async save slows training: steps beside the background writes

Command: `{command}` (one process, `benchmarks/checkpoint.py`'s model, 1.0 GB of state, training with 2 intra-op
threads on this machine's 2 cores; `AsyncCheckpointer` every {args.every} steps, {args.steps} steps, writer at nice
{args.writer_nice}; machine: {machine()}). Step periods against the median period of the {len(quiet)} steps that
neither overlapped a write nor staged a save ({base * 1e3:.0f} ms). The first save also allocates the staging buffers.

| save | write, s | steps it overlapped | their periods / median | the two steps after it |
|---|---|---|---|---|
""" + "\n".join(rows) + "\n")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
