"""How long starting ranks takes: ``spawn`` against a preloaded ``forkserver`` (``start_method`` of the strategy).

Starts ``--ranks`` processes running a function that does nothing, with torch's ``start_processes``, and times each
launch until every rank has exited: ``--launches`` times with ``spawn`` (each rank a new interpreter importing torch,
Lightning and the pack) and with ``forkserver`` preloaded as the strategy preloads it
(:func:`lightning_ciuic.strategies.launchers.preload_forkserver`); the forkserver's first launch also starts the
server, once per process, and is reported apart. Writes the ``launch`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/launch.py [--ranks 2] [--launches 3]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import machine, write_section  # noqa: E402
from lightning_ciuic.strategies.launchers import preload_forkserver  # noqa: E402


def nothing(rank: int) -> None:
    """A rank that only starts: what is timed is the launch."""


def launch_seconds(ranks: int, start_method: str) -> float:
    start = time.perf_counter()
    mp.start_processes(nothing, nprocs=ranks, start_method=start_method)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    spawn = [launch_seconds(args.ranks, "spawn") for _ in range(args.launches)]
    preload_forkserver()
    first = launch_seconds(args.ranks, "forkserver")
    forked = [launch_seconds(args.ranks, "forkserver") for _ in range(args.launches)]
    command = shlex.join([".venv/bin/python", "benchmarks/launch.py", *sys.argv[1:]])
    write_section("launch", f"""## Starting ranks: spawn against a preloaded forkserver

Command: `{command}` ({args.ranks} ranks running a function that does nothing, each launch timed until every rank
has exited; machine: {machine()}).

| start method | seconds per launch: median (launches) |
|---|---|
| spawn | **{statistics.median(spawn):.2f}** ({', '.join(f'{s:.2f}' for s in spawn)}) |
| forkserver, the first launch (it starts the server, which imports torch, Lightning and the pack) | {first:.2f} |
| forkserver, later launches | **{statistics.median(forked):.2f}** ({', '.join(f'{s:.2f}' for s in forked)}) |
""")
    print(f"spawn {spawn}, forkserver first {first:.2f}, later {forked}")


if __name__ == "__main__":
    main()
