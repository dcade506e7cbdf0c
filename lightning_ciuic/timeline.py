"""What runs beside the training step, as timed spans: one bounded, process-wide record.

Contract: :data:`timeline` is this process's record. Components record spans whether or not anyone reads them:
checkpoint staging (category ``checkpoint``, on the training thread: a stall) and writes (same category, on the
writer's thread), snapshots (``snapshot``), DiLoCo outer syncs (``outer_sync``), sampled tensor-parallel collectives
(``tp``). Times are ``time.perf_counter`` readings; :func:`wall_clock` makes them epoch seconds, comparable across
processes of one host (and across hosts as far as their clocks agree). :data:`STALLS` are the categories that stop
training while they run on its thread. The telemetry's step records and the communication monitor's breakdown
and Chrome trace read it. No Lightning imports.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

_HISTORY = 100_000  # spans kept
STALLS = ("checkpoint", "snapshot", "outer_sync")  # span categories that stop training while they run on its thread
_WALL_OFFSET = time.time() - time.perf_counter()


def wall_clock(perf_counter_seconds: float) -> float:
    """A ``time.perf_counter`` reading of this process as seconds since the epoch (comparable across processes)."""
    return perf_counter_seconds + _WALL_OFFSET


@dataclass(frozen=True)
class Span:
    name: str
    category: str
    start: float  # time.perf_counter
    end: float
    track: str  # the thread it ran on, or a name such as "tp collectives"


class Timeline:
    """Spans of work beside the training step, process-wide and bounded; see the module docstring."""

    def __init__(self) -> None:
        self._spans: deque[Span] = deque(maxlen=_HISTORY)
        self._lock = threading.Lock()  # writers on other threads append while the training thread reads

    def record(self, name: str, category: str, start: float, end: Optional[float] = None, track: Optional[str] = None) -> None:
        end = time.perf_counter() if end is None else end
        with self._lock:
            self._spans.append(Span(name, category, start, end, track or threading.current_thread().name))

    @contextmanager
    def span(self, name: str, category: str, track: Optional[str] = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, category, start, track=track)

    def ending_within(self, start: float, end: float) -> list[Span]:
        """Spans that ended in ``(start, end]``, oldest first."""
        found = []
        with self._lock:
            for span in reversed(self._spans):  # appended as they end: stop at the first that ended before
                if span.end <= start:
                    break
                if span.end <= end:
                    found.append(span)
        return found[::-1]


timeline = Timeline()
