"""How often a spawned gloo rank aborts at exit: Lightning's ``ddp_spawn`` as it ends, with and without the pack.

Each run spawns ``--ranks`` processes that join a gloo group, wrap a layer in ``DistributedDataParallel`` (kept
alive until exit, as Lightning's spawned worker keeps its Trainer), train a few steps with barriers and gathers, and
register Lightning's exit handler (``destroy_process_group``). Runs alternate between a bare rank and one that made the
pack's :class:`~lightning_ciuic.telemetry.Telemetry` (every measuring callback does). A run whose rank ended by a signal
(SIGABRT: "terminate called without an active exception") counts as aborted. Writes the ``exit_aborts`` section of
docs/benchmarks.md.

    .venv/bin/python benchmarks/exit_aborts.py [--runs 40] [--ranks 2]
"""

from __future__ import annotations

import argparse
import atexit
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import machine, write_section  # noqa: E402
from lightning_ciuic.testing.ports import free_port  # noqa: E402

_KEEP: list[object] = []  # what a Lightning worker holds until exit: the DDP-wrapped module, the Trainer


class _TrainerLike:
    def __init__(self, module: torch.nn.Module) -> None:
        self.lightning_module = module


def rank_main(rank: int, ranks: int, port: int, with_pack: bool) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=ranks, init_method=f"tcp://127.0.0.1:{port}")
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())  # Lightning's exit handler
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))
    _KEEP.append(model)
    if with_pack:
        from lightning_ciuic.telemetry import Telemetry

        trainer = _TrainerLike(model.module)
        _KEEP.append(trainer)
        Telemetry.of(trainer)
    t = torch.ones(3)
    for _ in range(20):
        model(t[None]).sum().backward()
        dist.barrier()
        dist.all_gather([torch.empty(3) for _ in range(ranks)], t)


def aborted(ranks: int, with_pack: bool) -> bool:
    try:
        mp.spawn(rank_main, args=(ranks, free_port(), with_pack), nprocs=ranks)
    except mp.ProcessExitedException as error:
        return error.signal_name is not None
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40, help="runs of each kind, alternating")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    counts = {False: 0, True: 0}
    for _ in range(args.runs):
        for with_pack in (False, True):
            counts[with_pack] += aborted(args.ranks, with_pack)
    command = shlex.join([".venv/bin/python", "benchmarks/exit_aborts.py", *sys.argv[1:]])
    write_section("exit_aborts", f"""## Spawned gloo ranks aborting at exit

Command: `{command}` ({args.ranks} spawned ranks per run, each holding a DDP module and its gloo group until exit,
as Lightning's `ddp_spawn` worker does; runs alternate; machine: {machine()}).

| rank | runs that ended by a signal (SIGABRT) |
|---|---|
| bare (Lightning's exit handler only) | **{counts[False]}** of {args.runs} |
| with the pack's telemetry (any measuring callback) | **{counts[True]}** of {args.runs} |
""")
    print(f"aborted: bare {counts[False]}/{args.runs}, with the pack {counts[True]}/{args.runs}")


if __name__ == "__main__":
    main()
