"""What a pipeline chunk holds while it waits for its weight backward (the zero-bubble schedules, DualPipeV).

Two parts, both exact, no timing:

* Bytes: blocks of the example DeepSeek-style decoder (``MODELS``: its small config, and DeepSeek-V3's head dimensions
  and latent at a quarter of its width) run one micro-batch's forward, then torch's input backward (``torch.distributed.pipelining``'s ``stage_backward_input``,
  what the zero-bubble schedules run for ``I``), then its weight backward (``W``). The bytes of every tensor made since
  the forward began and still alive are counted after each (a dispatch mode that tracks each new storage until it is
  freed), under each recomputation mode of ``gradient_checkpointing``: held after the forward, held while waiting for
  ``W``, and their ratio. torch keeps the chunk's whole graph from ``I`` to ``W`` (``retain_graph``), what recomputation
  rebuilt in ``I`` included, and the output gradients ``W`` starts from.
* Count: in torch's DualPipeV order (``pipeline_order``, what its runtime executes) for ``--pp`` ranks and
  ``--microbatches``, the most chunks one rank holds at once (its forward run, its backward not finished), the most
  of them waiting for ``W``, and, weighing a waiting chunk by each mode's ratio, each rank's peak in chunks.

Writes the ``weight_backward_memory`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/weight_backward_memory.py [--pp 16] [--microbatches 32]
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from benchmarks.common import machine, write_section  # noqa: E402
from examples.deepseek import DeepSeekConfig, DeepSeekTransformer  # noqa: E402
from lightning_ciuic import compat  # noqa: E402
from lightning_ciuic.parallel.pipeline import SCHEDULES  # noqa: E402
from lightning_ciuic.parallel.recompute import Recompute, recompute_blocks  # noqa: E402

MODES = ("none", {"recompute": ["norm", "mla_up"]}, "selective", "full")
# name: (the example decoder's config, blocks, micro-batch as sequences x tokens, recomputation modes)
MODELS = {
    "example decoder": (
        dict(dim=256, n_dense_layers=1, n_routed_experts=8, n_activated_experts=2, moe_inter_dim=128, dense_inter_dim=512,
             max_seq_len=512, kv_lora_rank=64, n_heads=8), 3, (2, 512), MODES,
    ),
    "DeepSeek-V3 at a quarter of its width": (  # its head dims and latent, 32 of its 128 heads, 8 of 32 experts per token
        dict(dim=1792, n_heads=32, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
             n_dense_layers=0, n_routed_experts=32, n_activated_experts=8, moe_inter_dim=512, max_seq_len=1024), 2, (1, 1024),
        MODES[:2],
    ),
}


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages made under it that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes, self._seen = 0, set()

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self._seen or size == 0:
            return
        self._seen.add(key)
        self.bytes += size

        def freed() -> None:
            self._seen.discard(key)
            self.bytes -= size

        weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out


def held(layers: torch.nn.ModuleList, dim: int, micro_batch: tuple[int, int]) -> tuple[int, int]:
    """Bytes held after one micro-batch's forward, and after its input backward (waiting for W)."""
    x = torch.randn(*micro_batch, dim, requires_grad=True)
    with LiveBytes() as live:
        y = x
        for layer in layers:
            y = layer(y)
        dy = torch.ones_like(y)
        gc.collect()
        after_forward = live.bytes - dy.untyped_storage().nbytes()
        _, groups = stage_backward_input([y], [dy], [x], layers.parameters())
        del y, dy
        gc.collect()
        waiting = live.bytes
        stage_backward_weight(layers.parameters(), groups)
    return after_forward, waiting


def dualpipev_holding(pp: int, microbatches: int, waiting_weight: float) -> list[tuple[float, int]]:
    """Per rank of DualPipeV's order: (the most it holds at once, in chunks held after their forward, a chunk waiting for
    W counting ``waiting_weight``; the most chunks waiting for W at once)."""
    order = compat.pipeline_schedule_order(SCHEDULES["dualpipev"].cls_name, pp, microbatches, 2)
    result = []
    for actions in order:
        full: set = set()
        waiting: set = set()
        most, most_waiting = 0.0, 0
        for parts in actions:
            for kind, stage, microbatch in parts:
                key = (stage, microbatch)
                if kind == "F":
                    full.add(key)
                elif kind == "I":
                    full.discard(key)
                    waiting.add(key)
                elif kind == "B":
                    full.discard(key)
                elif kind == "W":
                    waiting.discard(key)
                most = max(most, len(full) + waiting_weight * len(waiting))
                most_waiting = max(most_waiting, len(waiting))
        result.append((most, most_waiting))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=32)
    args = parser.parse_args()
    rows = []
    for name, (config, blocks, micro_batch, modes) in MODELS.items():
        for mode in modes:
            torch.manual_seed(0)
            layers = DeepSeekTransformer(DeepSeekConfig(n_layers=blocks, **config)).layers
            if mode != "none":
                recompute_blocks(list(layers), Recompute.parse(mode))
            held(layers, config["dim"], micro_batch)  # warm: what the first step builds lazily is not counted
            after_forward, waiting = held(layers, config["dim"], micro_batch)
            ratio = waiting / after_forward
            holding = [most for most, _ in dualpipev_holding(args.pp, args.microbatches, ratio)]
            rows.append(
                f"| {name} ({blocks} blocks, {micro_batch[0]} x {micro_batch[1]} tokens) | `{mode}` |"
                f" {after_forward / 2**20:.1f} | {waiting / 2**20:.1f} | **{ratio:.2f}x** |"
                f" {holding[0]:.1f} / {max(holding):.1f} / {holding[-1]:.1f} |"
            )
    counts = dualpipev_holding(args.pp, args.microbatches, 1.0)
    command = shlex.join([".venv/bin/python", "benchmarks/weight_backward_memory.py", *sys.argv[1:]])
    table = "\n".join(rows)
    write_section("weight_backward_memory", f"""## What a pipeline chunk holds while it waits for its weight backward

Command: `{command}` (machine: {machine()}). Bytes: blocks of the example decoder (its own small config, the first
block dense; and DeepSeek-V3's head dimensions and latent at a quarter of its width, all blocks experts), one
micro-batch in float32, through torch's input backward (`stage_backward_input`, the zero-bubble schedules' `I`), by `gradient_checkpointing`:

| model | recomputation | MiB held after the forward | MiB held waiting for W | ratio | DualPipeV's peak, chunks: rank 0 / most / last rank |
|---|---|---|---|---|---|
{table}

DualPipeV's order at pp {args.pp}, {args.microbatches} micro-batches (two chunks per rank, torch's `pipeline_order`):
the most chunks a rank holds at once, per rank: {[int(most) for most, _ in counts]}; the most of them waiting for W:
{[w for _, w in counts]}. The last column weighs a chunk waiting for W by the row's ratio: the rank's peak in chunks
held after their forward (equal on every rank where the ratio is small enough).
""")
    print(table)
    print("held per rank", [m for m, _ in counts], "waiting for W", [w for _, w in counts])


if __name__ == "__main__":
    main()
