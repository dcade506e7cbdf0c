"""Per-rank step timings: the one place that measures where a training step's time goes on this rank.

Contract:

* :meth:`Telemetry.of` gives the single ``Telemetry`` of a Trainer (created on first use). Callbacks that
  need timings (the data balancer, the communication monitor) call :meth:`begin` from
  ``on_train_batch_start`` and :meth:`end` from ``on_train_batch_end``; the first call for a batch records,
  later ones for the same batch are no-ops, so any number of consumers share one measurement.
* A :class:`StepRecord` per training batch, rank-local, in seconds:

  - ``data_wait``: end of the previous batch to the start of this one (fetching, host-to-device copy);
  - ``compute``: batch start to the moment the *last* gradient was produced (forward + backward). Gradient
    hooks time it, so a collective that waits for a slower rank after backward (DDP's final bucket wait,
    our synchronizer's ``finish``) is not counted: this is the rank's own speed;
  - ``sync_wait``: the last gradient to ``on_before_optimizer_step`` (reported through
    :meth:`before_optimizer_step`): gradient synchronization left exposed after backward, wherever the
    strategy waits for it (0 on accumulation micro-steps);
  - ``duration``: batch start to batch end (everything: compute, waits, optimizer step, callbacks).

  - ``start``: the batch start (``time.perf_counter``; :func:`lightning_ciuic.timeline.wall_clock` turns it into epoch seconds);
  - ``stalls``: seconds, per category of :data:`STALLS`, that :data:`timeline` spans recorded on this thread took
    within this step's period (the previous batch's end to this one's); ``data_wait`` excludes them.

* :func:`samples_in(batch)`: a training batch's samples, as Lightning counts them (``extract_batch_size``), and a
  middle pipeline stage's :class:`~lightning_ciuic.parallel.pipeline_module.NotRead` its ``batch_size`` (Lightning
  cannot size it): what the callbacks that count samples read.
* :meth:`records_since` hands each consumer the records after its own cursor; :func:`gather_per_rank`
  all-gathers one row of numbers per rank (``[world_size, k]``) over the default process group.
* A process whose ranks measure leaves its process groups cleanly at exit, whatever the strategy
  (:func:`~lightning_ciuic.parallel.shutdown.leave_at_exit`, registered when the first ``Telemetry`` is made): under
  Lightning's own ``ddp_spawn`` on gloo, the DDP wrapper still holds the default group at interpreter exit, and a gloo
  worker finishing its last work then aborts the process (SIGABRT) now and then.

Limits: timings are wall-clock on the host; on CUDA the caller must synchronize for them to mean device time.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_ciuic.compat import all_gather_single
from lightning_ciuic.parallel.pipeline_module import NotRead
from lightning_ciuic.parallel.shutdown import leave_at_exit
from lightning_ciuic.timeline import STALLS, timeline

_HISTORY = 100_000  # records kept; consumers read far more often than this


@dataclass(frozen=True)
class StepRecord:
    step: int  # trainer.global_step when the batch started
    batch_idx: int
    samples: int
    data_wait: float
    compute: float
    sync_wait: float
    duration: float
    optimizer_step: bool  # the batch ended with an optimizer step (not an accumulation micro-step)
    start: float = 0.0  # time.perf_counter at batch start
    stalls: dict[str, float] = field(default_factory=dict)  # category -> seconds, within this step's period



def samples_in(batch: Any) -> int:
    """A training batch's samples (see the module docstring)."""
    return batch.batch_size if isinstance(batch, NotRead) else extract_batch_size(batch)

class Telemetry:
    """Rank-local step timings of one Trainer, shared by every callback that reads them."""

    _by_trainer: "weakref.WeakKeyDictionary[Trainer, Telemetry]" = weakref.WeakKeyDictionary()

    def __init__(self, module: LightningModule) -> None:
        self._records: deque[StepRecord] = deque(maxlen=_HISTORY)
        self._count = 0
        self._open: Optional[tuple[int, int, int, float, float]] = None  # (step, batch_idx, samples, wait, start)
        self._last_end: Optional[float] = None
        self._last_grad = 0.0
        self._sync_mark = 0.0
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad) for p in module.parameters() if p.requires_grad
        ]

    @classmethod
    def of(cls, trainer: Trainer) -> "Telemetry":
        """The Trainer's telemetry, created (gradient hooks installed) on first use."""
        telemetry = cls._by_trainer.get(trainer)
        if telemetry is None:
            telemetry = cls._by_trainer[trainer] = cls(trainer.lightning_module)
            leave_at_exit()
        return telemetry

    @classmethod
    def release(cls, trainer: Trainer) -> None:
        """Remove the Trainer's gradient hooks (idempotent; call at teardown)."""
        telemetry = cls._by_trainer.pop(trainer, None)
        if telemetry is not None:
            for handle in telemetry._handles:
                handle.remove()

    def _on_grad(self, _param: torch.Tensor) -> None:
        self._last_grad = time.perf_counter()

    def begin(self, step: int, batch_idx: int, batch: Any) -> None:
        if self._open is not None and self._open[:2] == (step, batch_idx):
            return
        now = time.perf_counter()
        wait = 0.0 if self._last_end is None else now - self._last_end
        samples = samples_in(batch) if batch is not None else 0
        self._last_grad = self._sync_mark = 0.0
        self._open = (step, batch_idx, samples, wait, now)

    def before_optimizer_step(self) -> None:
        if self._open is not None and not self._sync_mark:
            self._sync_mark = time.perf_counter()

    def end(self) -> None:
        if self._open is None:
            return
        step, batch_idx, samples, wait, start = self._open
        now = time.perf_counter()
        grads_done = self._last_grad if self._last_grad > start else now
        sync_wait = max(0.0, self._sync_mark - grads_done) if self._sync_mark else 0.0
        stalls: dict[str, float] = {}
        period_start = start - wait
        thread = threading.current_thread().name
        for span in timeline.ending_within(period_start, now):
            if span.category in STALLS and span.track == thread:
                stalls[span.category] = stalls.get(span.category, 0.0) + span.end - max(span.start, period_start)
                wait -= max(0.0, min(span.end, start) - max(span.start, period_start))  # the part inside the gap
        self._records.append(
            StepRecord(
                step, batch_idx, samples, max(0.0, wait), grads_done - start, sync_wait, now - start,
                bool(self._sync_mark), start, stalls,
            )
        )
        self._count += 1
        self._open, self._last_end = None, now

    def records_since(self, cursor: int) -> tuple[list[StepRecord], int]:
        """Records numbered ``>= cursor`` that are still kept, and the cursor to pass next time."""
        first_kept = self._count - len(self._records)
        start = max(cursor, first_kept) - first_kept
        return [self._records[i] for i in range(start, len(self._records))], self._count


def gather_per_rank(trainer: Trainer, values: list[float]) -> torch.Tensor:
    """All ranks' ``values`` as a ``[world_size, len(values)]`` float64 tensor (same on every rank)."""
    row = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
    if not dist.is_initialized() or trainer.world_size == 1:
        return row.reshape(1, len(values)).cpu()
    gathered = row.new_empty(trainer.world_size * len(values))
    all_gather_single(gathered, row)  # not strategy.all_gather: Lightning's goes through a deprecated torch API
    return gathered.reshape(trainer.world_size, len(values)).cpu()
