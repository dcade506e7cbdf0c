"""What a background save's own work does to the training steps it runs beside, part by part.

One process trains ``benchmarks/checkpoint.py``'s model (5 layers of 4096 x 4096, Adam: 1.0 GB of state) with
``--threads`` intra-op threads, while one thread at nice 19 (as the shipped writer, ``_lowest_priority``) repeats
one part of an async save over a page-aligned 1.0 GB staged copy of that state, in the chunks the store uses:

* ``none``: nothing beside training;
* ``hash``: BLAKE3 over every chunk (what names chunks);
* ``write``: every chunk written to local disk with ``O_DIRECT`` (``Storage.write_atomic``, as shipped);
* ``hash + write``: both, chunk by chunk: the writer's own work in a save (without DCP's planning).

Each mode runs ``--steps`` timed training steps with the part repeating throughout (it starts before the first);
modes alternate over ``--rounds`` rounds, after one round that is not counted (the first steps after the state is
staged run slow on this machine, which flattered the parts that follow); a mode's step time is the median of its steps, as a ratio to ``none`` in
the same round, the median of rounds in bold. The ratio inverted is the throughput a save's part leaves training:
the floor of "throughput during a write" for that part where training takes every core. Writes the
``writer_interference`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/writer_interference.py [--rounds 5] [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.checkpoint import Wide  # noqa: E402
from benchmarks.common import machine, write_section  # noqa: E402
from lightning_ciuic.checkpoint.incremental import CHUNK_BYTES, digest  # noqa: E402
from lightning_ciuic.checkpoint.storage import Storage, page_aligned_empty  # noqa: E402
from lightning_ciuic.plugins.checkpoint_io import _lowest_priority  # noqa: E402

MODES = ("none", "hash", "write", "hash + write")


class Part(threading.Thread):
    """Repeats ``mode``'s part of a save over ``staged`` at nice 19 until stopped; counts the bytes it got through."""

    def __init__(self, mode: str, staged: memoryview, storage: Storage) -> None:
        super().__init__(daemon=True)
        self.mode, self.staged, self.storage = mode, staged, storage
        self.stop, self.bytes = threading.Event(), 0

    def run(self) -> None:
        _lowest_priority()
        while not self.stop.is_set():
            for i, start in enumerate(range(0, len(self.staged), CHUNK_BYTES)):
                if self.stop.is_set():
                    return
                chunk = self.staged[start : start + CHUNK_BYTES]
                if "hash" in self.mode:
                    digest(chunk)
                if "write" in self.mode:
                    self.storage.write_atomic(f"chunk{i}", chunk)
                self.bytes += len(chunk)


def timed_steps(module: Wide, optimizer: torch.optim.Optimizer, batch: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        module.training_step((batch,), 0).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="training's intra-op threads (2: every core here)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    module = Wide()
    optimizer = module.configure_optimizers()
    batch = torch.randn(8, module.width)
    timed_steps(module, optimizer, batch, 3)  # Adam's moments exist from here: the state is whole
    state = [t for p in module.parameters() for t in (p, *optimizer.state[p].values()) if t.dim() > 0]
    staged = page_aligned_empty((sum(t.numel() for t in state) * 4,), torch.uint8)
    offset = 0
    for t in state:
        staged[offset : offset + t.numel() * 4].copy_(t.detach().reshape(-1).view(torch.uint8))
        offset += t.numel() * 4
    view = memoryview(staged.numpy())
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[1]) as tmp:  # local disk: O_DIRECT
        storage = Storage(tmp)
        for round_index in range(args.rounds + 1):  # round 0 warms up, not counted
            medians, rate = {}, {}
            for mode in MODES:
                part = Part(mode, view, storage)
                if mode != "none":
                    part.start()
                    time.sleep(0.5)  # under way before the first timed step
                began = time.perf_counter()
                medians[mode] = statistics.median(timed_steps(module, optimizer, batch, args.steps))
                elapsed = time.perf_counter() - began
                part.stop.set()
                if mode != "none":
                    part.join()
                rate[mode] = part.bytes / elapsed / 1e9
            print({m: round(medians[m] / medians["none"], 3) for m in MODES}, flush=True)
            if round_index == 0:
                continue
            for mode in MODES:
                ratios[mode].append(medians[mode] / medians["none"])
            for mode in MODES:
                rates[mode].append(rate[mode])
    rows = [
        f"| {mode} | **{statistics.median(ratios[mode]):.2f}** ({', '.join(f'{r:.2f}' for r in ratios[mode])}) |"
        f" {1 / statistics.median(ratios[mode]):.0%} | {statistics.median(rates[mode]):.2f} |"
        for mode in MODES
    ]
    command = shlex.join([".venv/bin/python", "benchmarks/writer_interference.py", *sys.argv[1:]])
    write_section("writer_interference", f"""## What a save's own work does to the training beside it

Command: `{command}` (one process, `benchmarks/checkpoint.py`'s model: 5 layers of 4096 x 4096, Adam, {len(view) / 1e9:.2f} GB
of state, batch 8; training with {args.threads} intra-op threads; beside it one thread at nice 19, as the shipped writer,
repeating one part of a save over a page-aligned staged copy of the state in {CHUNK_BYTES >> 20} MB chunks; {args.steps}
timed steps per mode, the median; modes alternating over {args.rounds} rounds after one not counted; machine:
{machine()}).

| part repeating beside training | step time / nothing beside: median (rounds) | throughput left to training | GB/s the part got through |
|---|---|---|---|
""" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
