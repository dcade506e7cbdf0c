"""Our incremental checkpoints against torch DCP's ``async_save``: bytes written, and time to the first step after a restore.

One process on the CPU, a stack of ``--layers`` linear layers of ``--width`` (bias-free) trained with Adam on random
data, in three set-ups users compare:

* ``pre-training``: every layer trains (parameters and both Adam moments change every step);
* ``frozen 90%``: the first 90% of the layers are frozen (fine-tuning the top): their weights never change and have
  no Adam state;
* ``LoRA``: every base weight frozen, a rank-``--rank`` adapter (A: r x width, B: width x r) per layer trains.

For each, after one training step both save the same state (``{"model": ..., "optim": ...}`` from torch's
``get_state_dict``), 3 more steps, both save again. Bytes written are the growth of each one's directory (every
file: chunks, manifests, DCP's ``.distcp`` files and metadata). Ours is DCP's ``save`` through our
:class:`~lightning_ciuic.checkpoint.dcp.ChunkedWriter` into a :class:`~lightning_ciuic.checkpoint.incremental.ChunkStore`,
the path ``AsyncCheckpointer`` takes under ``HybridParallelStrategy`` (BLAKE3-named chunks, zstd level 3,
incremental); DCP's is ``torch.distributed.checkpoint.async_save`` of the same dictionary to its file system writer.

Time to the first step after a restore (pre-training state): a fresh process builds the model and optimizer, then
is timed from the start of the load to the end of one training step: ours (``dcp.load`` through our
:class:`~lightning_ciuic.checkpoint.dcp.ChunkedReader`, into the model's and optimizer's own tensors), ours as one
whole state (``load_full``, what ``DDPStrategy`` checkpoints and exports use: new tensors, then copied in) and DCP's
(``dcp.load`` from its files), each + ``set_state_dict`` and one step, alternating, ``--rounds``
rounds, with the page cache dropped before each restore when this process may (root), so the files are read from
disk as after a restart; the tables say which. Writes the ``checkpoint_vs_dcp`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/checkpoint_vs_dcp.py [--layers 10] [--width 2048] [--rank 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from benchmarks.common import machine, write_section  # noqa: E402
from lightning_ciuic.checkpoint.dcp import ChunkedReader, ChunkedWriter, load_full, save_full  # noqa: E402
from lightning_ciuic.checkpoint.incremental import ChunkStore  # noqa: E402
from lightning_ciuic.checkpoint.storage import Storage  # noqa: E402

SETUPS = ["pre-training", "frozen 90%", "LoRA"]
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Adapted(torch.nn.Module):
    """A bias-free linear layer with an optional low-rank adapter (B @ A, B starting at zero)."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width, bias=False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, width) / width ** 0.5) if rank else None
        self.lora_b = torch.nn.Parameter(torch.zeros(width, rank)) if rank else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        return out + x @ self.lora_a.T @ self.lora_b.T if self.lora_a is not None else out


def build(setup: str, layers: int, width: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Adapted(width, rank if setup == "LoRA" else 0) for _ in range(layers)])
    frozen = {"pre-training": 0, "frozen 90%": round(0.9 * layers), "LoRA": layers}[setup]
    for layer in list(model)[:frozen]:
        layer.base.weight.requires_grad_(False)
    return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, width: int) -> None:
    x = torch.randn(8, width)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bytes_written(setup: str, args: argparse.Namespace, tmp: Path) -> dict:
    """Bytes each one's directory grew by at the first and the second checkpoint, and the state's size."""
    model, optimizer = build(setup, args.layers, args.width, args.rank)
    ours_dir, dcp_dir = tmp / f"ours-{setup}", tmp / f"dcp-{setup}"
    store = ChunkStore(Storage(str(ours_dir)), "zstd", 3)
    result = {"ours": [], "dcp": []}
    for save in range(2):
        train_step(model, optimizer, args.width)
        if save:
            for _ in range(2):
                train_step(model, optimizer, args.width)
        state = state_of(model, optimizer)
        before = directory_bytes(ours_dir) if ours_dir.exists() else 0
        dcp.save(state, storage_writer=ChunkedWriter(store, f"step{save}"))
        result["ours"].append(directory_bytes(ours_dir) - before)
        before = directory_bytes(dcp_dir) if dcp_dir.exists() else 0
        dcp.async_save(state, checkpoint_id=str(dcp_dir / f"step{save}")).result()
        result["dcp"].append(directory_bytes(dcp_dir) - before)
    if setup == "pre-training":  # the same state as one whole-state checkpoint (DDPStrategy's and export's format)
        save_full(ChunkStore(Storage(str(tmp / "ours-whole")), "zstd", 3), "step1", state)
    result["state"] = sum(t.numel() * t.element_size() for t in _tensors(state))
    result["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad) / sum(p.numel() for p in model.parameters())
    return result


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def restore(kind: str, path: str, args: argparse.Namespace) -> dict:
    """In this (fresh) process: seconds from the start of the load to the end of the first training step."""
    model, optimizer = build("pre-training", args.layers, args.width, args.rank)
    start = time.perf_counter()
    if kind == "ours, whole state":
        state = load_full(ChunkStore(Storage(path)), "step1")
    else:
        state = state_of(model, optimizer)
        reader = ChunkedReader(ChunkStore(Storage(path)), "step1") if kind == "ours" else None
        dcp.load(state, checkpoint_id=None if reader else path + "/step1", storage_reader=reader)
    loaded = time.perf_counter()
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    applied = time.perf_counter()
    train_step(model, optimizer, args.width)
    end = time.perf_counter()
    return {"load": loaded - start, "apply": applied - loaded, "step": end - applied, "total": end - start}


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--restore", default="", help="worker: 'ours' or 'dcp' and the directory, KIND:PATH")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.restore:
        kind, path = args.restore.split(":", 1)
        print(json.dumps(restore(kind, path, args)))
        return

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP", "/var/tmp")) as tmp_name:
        tmp = Path(tmp_name)
        written = {setup: bytes_written(setup, args, tmp) for setup in SETUPS}
        timings: dict[str, list[dict]] = {"ours": [], "ours, whole state": [], "dcp": []}
        cold = True
        whole = tmp / "ours-whole"
        for _ in range(args.rounds):
            for kind in timings:
                cold = drop_page_cache() and cold
                path = whole if kind == "ours, whole state" else tmp / f"{kind}-pre-training"
                out = subprocess.run(
                    [sys.executable, __file__, "--restore", f"{kind}:{path}", "--layers", str(args.layers), "--width",
                     str(args.width), "--rank", str(args.rank)], check=True, capture_output=True, text=True,
                )
                timings[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(kind, timings[kind][-1], flush=True)

    rows = []
    for setup, r in written.items():
        rows.append(
            f"| {setup} | {r['trainable']:.1%} | {r['state'] / 1e6:.0f} MB | {r['ours'][0] / 1e6:.1f} / {r['dcp'][0] / 1e6:.1f} MB |"
            f" {r['ours'][1] / 1e6:.1f} MB | {r['dcp'][1] / 1e6:.1f} MB | **{r['ours'][1] / r['dcp'][1]:.2f}** |"
        )

    def timing(kind: str, part: str) -> str:
        values = [t[part] for t in timings[kind]]
        return f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"

    def ratios(kind: str) -> str:
        values = [o["total"] / d["total"] for o, d in zip(timings[kind], timings["dcp"])]
        return f"**{statistics.median(values):.2f}** (rounds {', '.join(f'{r:.2f}' for r in values)})"

    restore_rows = [
        f"| {label} | {' | '.join(timing(kind, part) for kind in timings)} |"
        for label, part in (("load (read, verify, decompress)", "load"), ("into model and optimizer", "apply"),
                            ("first training step", "step"), ("total", "total"))
    ]
    write_section(
        "checkpoint_vs_dcp",
        f"""
## Incremental checkpoints against DCP's async_save: bytes, and time to the first step after a restore

Command: `.venv/bin/python benchmarks/checkpoint_vs_dcp.py --layers {args.layers} --width {args.width} --rank {args.rank} --rounds {args.rounds}`
(one process, {args.layers} bias-free linear layers of {args.width} x {args.width}, Adam; the same state dictionary
from torch's `get_state_dict` saved by both; ours: `save_full` into a chunk store as `AsyncCheckpointer` keeps it
(BLAKE3-named chunks, zstd level 3, incremental); DCP: `torch.distributed.checkpoint.async_save`; bytes = growth of
each one's directory, every file counted; machine: {machine()}).

| set-up | trainable parameters | state | first checkpoint: ours / DCP | second checkpoint (3 steps later): ours | DCP | ours / DCP |
|---|---|---|---|---|---|---|
""" + "\n".join(rows) + f"""

Time to the first training step after a restore of the pre-training state (a fresh process each, model and
optimizer built before the clock starts; page cache {'dropped before each restore: files read from disk' if cold else 'not dropped (not root): files read from memory'};
seconds, median of {args.rounds} alternating rounds with each round's in brackets): ours / DCP {ratios('ours')};
ours as one whole state / DCP {ratios('ours, whole state')}.

| part | ours: DCP load through `ChunkedReader` (s) | ours: `load_full`, whole state (s) | DCP (s) |
|---|---|---|---|
""" + "\n".join(restore_rows) + "\n",
    )
    print("\n".join(rows + restore_rows))


if __name__ == "__main__":
    main()
