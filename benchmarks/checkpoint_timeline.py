"""Where an async save slows training: each step's period beside the background writes, on one clock.

One process trains ``benchmarks/checkpoint.py``'s model (1.0 GB of state, two intra-op threads) for ``--steps`` steps
with ``AsyncCheckpointer`` saving every ``--every`` steps to a local directory (``--dir``), the writer at nice 19 as
shipped or at nice 0 (``--writer-nice 0``). The writes' spans come from :data:`lightning_ciuic.timeline.timeline`
(the writer records each), the steps' periods from ``benchmarks.checkpoint.StepTimes``. For each save: how long its
write ran, the steps that overlapped it (their periods against the median period of the steps that overlapped
none and did not stage one), and the two steps after it; then, for the quiet steps, those beside a write and those
that staged a save, the median period and the process's minor page faults and system CPU time per step.
``--keep-freed-memory`` runs it with glibc's malloc keeping freed memory (``benchmarks.common.KEEP_FREED_MEMORY``),
so training stops faulting in fresh pages every step. Writes the ``checkpoint_timeline`` section (or ``--section``)
of docs/benchmarks.md.

    .venv/bin/python benchmarks/checkpoint_timeline.py [--steps 42] [--every 10] [--writer-nice 19] [--keep-freed-memory] [--dir PATH]
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
from benchmarks.common import machine, malloc_settings, write_section  # noqa: E402
from lightning_ciuic import AsyncCheckpointer  # noqa: E402
from lightning_ciuic.timeline import timeline  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=42)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--writer-nice", type=int, default=19, choices=[0, 19])
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parents[1]), help="where the checkpoints go")
    parser.add_argument("--keep-freed-memory", action="store_true", help="glibc malloc keeps freed memory (re-runs the script)")
    parser.add_argument("--section", default="checkpoint_timeline")
    args = parser.parse_args()
    allocator = malloc_settings(args.keep_freed_memory)
    torch.set_num_threads(2)
    if args.writer_nice == 0:
        checkpoint_io._lowest_priority = lambda: None  # the executor's initializer, looked up when it starts
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        callback = AsyncCheckpointer(f"{tmp}/ckpt", save_interval=None, every_n_train_steps=args.every, save_on_train_end=False)
        timer = StepTimes(callback.io)
        began = time.perf_counter()
        fit([callback], args.steps, io=callback.io, timer=timer)
    ends = [start + period for start, period in zip(timer.starts, timer.periods)]
    writes = [s for s in timeline.ending_within(began, time.perf_counter()) if s.name == "checkpoint write"]
    # a save is staged in the step whose period its write starts in (in the batch-end hook); the steps after it overlap
    spanned = [[i for i, (s, e) in enumerate(zip(timer.starts, ends)) if s < w.end and e > w.start] for w in writes]
    writes, spanned = [w for w, s in zip(writes, spanned) if s], [s for s in spanned if s]  # not one begun after the last step
    stagers, overlapping = [steps[0] for steps in spanned], [steps[1:] for steps in spanned]
    staging = set(stagers)
    quiet = [i for i in range(3, len(timer.periods)) if i not in staging and not any(i in o for o in overlapping)]
    base = statistics.median(timer.periods[i] for i in quiet)
    rows = []
    for k, (write, stager, steps) in enumerate(zip(writes, stagers, overlapping)):
        last = steps[-1] if steps else stager
        after = [i for i in range(last + 1, last + 3) if i < len(timer.periods)]
        during = ", ".join(f"{timer.periods[i] / base:.2f}" for i in steps)
        rows.append(
            f"| {k + 1} | {timer.periods[stager] / base:.2f} | {write.end - write.start:.2f} | {len(steps)} | {during} |"
            f" {', '.join(f'{timer.periods[i] / base:.2f}' for i in after)} |"
        )
    beside = sorted({i for steps in overlapping for i in steps})
    groups = [
        ("quiet (neither beside a write nor staging)", quiet),
        ("beside a write", beside),
        ("staging the first save", stagers[:1]),
        ("staging a later save", stagers[1:]),
    ]
    kinds = [
        f"| {label} | {len(steps)} | {statistics.median(timer.periods[i] for i in steps) * 1e3:.0f} |"
        f" {statistics.median(timer.system[i] for i in steps):.2f} | {statistics.median(timer.faults[i] for i in steps) * 4096 / 1e6:.0f} |"
        for label, steps in groups if steps
    ]
    command = shlex.join([".venv/bin/python", "benchmarks/checkpoint_timeline.py", *sys.argv[1:]])
    write_section(args.section, f"""## Where an async save slows training: steps beside the background writes

Command: `{command}` (one process, `benchmarks/checkpoint.py`'s model, 1.0 GB of state, training with 2 intra-op
threads on this machine's 2 cores; `AsyncCheckpointer` every {args.every} steps, {args.steps} steps, writer at nice
{args.writer_nice}; {allocator}; machine: {machine()}). Step periods against the median period of the {len(quiet)} steps that
neither overlapped a write nor staged a save ({base * 1e3:.0f} ms). A save is staged in the batch-end hook of the step
whose period the table calls the staging step; the first save also allocates the staging buffers.

| save | staging step / median | write, s | steps it overlapped after that | their periods / median | the two steps after it |
|---|---|---|---|---|---|
""" + "\n".join(rows) + """

The same steps by kind, medians per step: the process's system CPU time (every thread's: training's and the
writer's) and the fresh memory it faulted in (minor page faults x 4 kB).

| steps | count | period, ms | system CPU, s | faulted in, MB |
|---|---|---|---|---|
""" + "\n".join(kinds) + "\n")
    for row in rows + kinds:
        print(row)


if __name__ == "__main__":
    main()
