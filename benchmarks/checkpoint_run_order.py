"""What a ModelCheckpoint run leaves behind for the run after it, in the same process.

``benchmarks/checkpoint.py`` runs no checkpointing, ``ModelCheckpoint`` and ``AsyncCheckpointer`` one after another
in one process. This measures what the order does to the ``AsyncCheckpointer`` run (``--steps`` steps, a save every
``--every``), each scenario in a fresh process, scenarios alternating over ``--rounds`` rounds:

* ``alone``: a no-checkpoint run, then the async run;
* ``after ModelCheckpoint``: a no-checkpoint run, a ``ModelCheckpoint`` run (its files then deleted), the async run;
* ``after ModelCheckpoint, caches dropped``: the same, the kernel's clean caches dropped before the async run (root),
  as ``benchmarks/checkpoint.py`` now does before every run.

For the async run: its cost per save (run time minus the no-checkpoint run's, over the saves made), the throughput of
the steps while a save was written (against the no-checkpoint run's median step), and the median system CPU time of
its steps before the first save against the no-checkpoint run's. Writes the ``checkpoint_run_order`` section of
docs/benchmarks.md.

    sudo .venv/bin/python benchmarks/checkpoint_run_order.py [--steps 90] [--every 15] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from benchmarks.checkpoint import StepTimes, drop_caches, fit  # noqa: E402
from benchmarks.common import machine, write_section  # noqa: E402
from lightning_ciuic import AsyncCheckpointer  # noqa: E402

SCENARIOS = ("alone", "after ModelCheckpoint", "after ModelCheckpoint, caches dropped")


def scenario(name: str, steps: int, every: int) -> dict:
    """One scenario's runs in this process; the async run's figures."""
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        none = StepTimes()
        _, _, none_total = fit([], steps, timer=none)
        if name != "alone":
            fit([ModelCheckpoint(dirpath=f"{tmp}/mc", every_n_train_steps=every, save_top_k=-1)], steps, fresh=False)
            shutil.rmtree(f"{tmp}/mc")
        callback = AsyncCheckpointer(f"{tmp}/async", save_interval=None, every_n_train_steps=every, save_on_train_end=False)
        timer = StepTimes(callback.io)
        _, _, total = fit([callback], steps, io=callback.io, timer=timer, fresh=name.endswith("dropped"))
    base = statistics.median(none.periods[1:])
    during = [p for p, busy in zip(timer.periods, timer.busy) if busy]
    return {
        "per_save": (total - none_total) / max(1, callback.saves),
        "during": base / statistics.fmean(during),
        "system": statistics.median(timer.system[1 : every - 1]),
        "none_system": statistics.median(none.system[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--every", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scenario", choices=SCENARIOS, help="run one scenario here and print its figures (internal)")
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps(scenario(args.scenario, args.steps, args.every)))
        return
    if not drop_caches():
        sys.exit("run as root: the third scenario drops the kernel's caches")
    results: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    for _ in range(args.rounds):
        for name in SCENARIOS:
            out = subprocess.run(
                [sys.executable, __file__, "--scenario", name, "--steps", str(args.steps), "--every", str(args.every)],
                check=True, capture_output=True, text=True,
            ).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
            print(name, results[name][-1], flush=True)

    def cell(name: str, key: str, fmt: str) -> str:
        values = [r[key] for r in results[name]]
        return f"{format(statistics.median(values), fmt)} ({', '.join(format(v, fmt) for v in values)})"

    rows = [
        f"| {name} | {cell(name, 'per_save', '.2f')} | {cell(name, 'during', '.0%')} | {cell(name, 'system', '.2f')} |"
        f" {cell(name, 'none_system', '.2f')} |"
        for name in SCENARIOS
    ]
    command = shlex.join(["sudo", ".venv/bin/python", "benchmarks/checkpoint_run_order.py", *sys.argv[1:]])
    write_section("checkpoint_run_order", f"""## What a ModelCheckpoint run leaves for the next run in the same process

Command: `{command}` (`benchmarks/checkpoint.py`'s model and runs: 1.0 GB of state, two intra-op threads,
{args.steps} steps, a save every {args.every}; each scenario in a fresh process, alternating, medians of {args.rounds}
rounds with each round's value; machine: {machine()}). The `AsyncCheckpointer` run's figures; its no-checkpoint run
came first in the same process.

| the async run came | cost per save, s | throughput while writing | system CPU per step before its first save, s | the no-checkpoint run's, s |
|---|---|---|---|---|
""" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
