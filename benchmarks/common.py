"""Benchmark plumbing: a per-step timer callback and the writer of results into docs/benchmarks.md.

Results are ratios measured side by side in one run (this machine is noisy); each section of
docs/benchmarks.md is replaced between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers and
carries the command that produced it.
"""

from __future__ import annotations

import datetime

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule

from lightning_ciuic.testing.ports import free_port  # noqa: F401  (the benchmarks import it from here)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"

# DeepSeekMini sizes used by the benchmarks (keyword arguments of examples.deepseek.DeepSeekMini).
MODELS = {
    "example": {},
    "medium": dict(dim=256, moe_inter_dim=256, dense_inter_dim=768, kv_lora_rank=64),
    "large": dict(dim=384, moe_inter_dim=384, dense_inter_dim=1152, kv_lora_rank=96),
}


class ByteMLP(LightningModule):
    """An 8M-parameter next-byte MLP (embedding, two hidden layers of ``hidden``, a byte head), AdamW as the example
    model's: a model whose step is mostly its gradient's size on the wire, beside the example's attention and
    experts. Takes ``ByteCorpusDataModule``'s batches."""

    def __init__(self, dim: int = 256, hidden: int = 2560, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(256, dim), torch.nn.Linear(dim, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 256),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(self.net(inputs).reshape(-1, 256), targets.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95))


def benchmark_model(name: str) -> LightningModule:
    """``"mlp"``: :class:`ByteMLP`; otherwise the DeepSeekMini size ``name`` of :data:`MODELS`."""
    from examples.deepseek import DeepSeekMini

    return ByteMLP() if name == "mlp" else DeepSeekMini(**MODELS[name])


def describe(model: torch.nn.Module, name: str) -> str:
    """``name (N.NNM params)``, counted, never typed in by hand."""
    return f"{name} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params)"


class StepTimer(Callback):
    """Rank 0 writes the wall time of every training step (batch start to batch end) and its loss to ``path`` as
    JSON."""

    def __init__(self, path: str) -> None:
        self.path, self.times, self.losses, self._start = str(path), [], [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            loss = trainer.callback_metrics.get("train/loss")
            Path(self.path).write_text(json.dumps(
                {"times": self.times, "losses": self.losses, "loss": None if loss is None else float(loss)}
            ))


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def spread(ratios: list[float]) -> str:
    """Per-round ratios as their median and range: ``0.995x (0.975-1.022)``."""
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"


def alternating(variants: tuple[str, ...], rounds: int):
    """``(round, variant)``: every variant once a round, the order reversed every other round (a drift of the
    machine falls on each variant alike)."""
    for r in range(rounds):
        for variant in (variants if r % 2 == 0 else variants[::-1]):
            yield r, variant


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


# glibc malloc settings that keep freed memory in the process, as jemalloc and tcmalloc do by default: blocks of any
# size come from the heap (by default those over 32 MB get a memory map of their own, unmapped when freed) and the heap
# is never trimmed. Without them a training step that frees and reallocates large tensors faults in fresh pages every
# time (``benchmarks/checkpoint.py``'s model: about 1 GB per step).
KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=17179869184"


def malloc_settings(keep_freed: bool) -> str:
    """With ``keep_freed``, re-run this script (same arguments) under ``GLIBC_TUNABLES=KEEP_FREED_MEMORY`` unless it
    already is (glibc reads it at start). Returns the allocator's settings, as a results header states them."""
    tunables = os.environ.get("GLIBC_TUNABLES")
    if keep_freed and tunables != KEEP_FREED_MEMORY:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": KEEP_FREED_MEMORY})
    return f"glibc malloc with `GLIBC_TUNABLES={tunables}`" if tunables else "glibc malloc, default settings"


def write_section(name: str, markdown: str) -> None:
    """Replace (or append) the ``name`` section of docs/benchmarks.md, ending with the date it was measured."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown.strip()}\n\nMeasured {datetime.date.today().isoformat()}.\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
