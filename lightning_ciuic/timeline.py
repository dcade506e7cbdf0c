"""What runs beside the training step, as timed spans: one bounded, process-wide record.

Contract: :data:`timeline` is this process's record. Components record spans whether or not anyone reads them:
checkpoint staging (category ``checkpoint``, on the training thread: a stall) and writes (same category, on the
writer's thread), snapshots (``snapshot``), DiLoCo outer syncs (``outer_sync``), sampled tensor-parallel collectives
(``tp``). Times are ``time.perf_counter`` readings; :func:`wall_clock` makes them epoch seconds, comparable across
processes of one host (and across hosts as far as their clocks agree); :func:`wall_clock_ns` makes them integer
epoch nanoseconds and keeps their order: a reading no later than another never converts to a later integer (so a
span that ended before the next began does not overlap it in the Chrome trace). :data:`STALLS` are the categories
that stop training while they run on its thread. The telemetry's step records and the communication monitor's
breakdown and Chrome trace read it. A span is recorded when it ends; :meth:`Timeline.running` names the spans of
:meth:`Timeline.span` that have started and not ended (a checkpoint still being written when training ends), so
a trace taken then can show them. No Lightning imports.
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
_WALL_OFFSET_NS = time.time_ns() - time.perf_counter_ns()  # the same offset, exact, for wall_clock_ns


def wall_clock(perf_counter_seconds: float) -> float:
    """A ``time.perf_counter`` reading of this process as seconds since the epoch (comparable across processes)."""
    return perf_counter_seconds + _WALL_OFFSET


def wall_clock_ns(perf_counter_seconds: float) -> int:
    """A ``time.perf_counter`` reading of this process as integer nanoseconds since the epoch: the reading rounded
    to nanoseconds first (``perf_counter`` is ``perf_counter_ns`` as a float: within a nanosecond for the first
    48 days of uptime, a few after years), then the offset added as an integer, so no precision is lost to an
    epoch-sized float (whose step is 0.24 us today), and the conversion never reverses the order of two readings."""
    return round(perf_counter_seconds * 1e9) + _WALL_OFFSET_NS


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
        self._running: dict[object, Span] = {}  # spans of span() not ended yet, by a token; their end is their start

    def record(self, name: str, category: str, start: float, end: Optional[float] = None, track: Optional[str] = None) -> None:
        end = time.perf_counter() if end is None else end
        with self._lock:
            self._spans.append(Span(name, category, start, end, track or threading.current_thread().name))

    @contextmanager
    def span(self, name: str, category: str, track: Optional[str] = None) -> Iterator[None]:
        start = time.perf_counter()
        track = track or threading.current_thread().name
        token = object()
        with self._lock:
            self._running[token] = Span(name, category, start, start, track)
        try:
            yield
        finally:
            end = time.perf_counter()
            with self._lock:  # leaves the running ones and joins the ended ones at one instant
                del self._running[token]
                self._spans.append(Span(name, category, start, end, track))

    def running(self) -> list[Span]:
        """Spans of :meth:`span` started and not yet ended, oldest first (each with ``end == start``)."""
        return self.now_since(float("inf"))[2]

    def now_since(self, start: float) -> tuple[float, list[Span], list[Span]]:
        """At one instant: the time, the spans that ended since ``start`` (:meth:`ending_within` up to it) and
        the spans running (:meth:`running`): a span that ends meanwhile is in exactly one of the two."""
        with self._lock:
            now = time.perf_counter()
            running = sorted(self._running.values(), key=lambda span: span.start)
            return now, self._ended_within(start, now), running

    def ending_within(self, start: float, end: float) -> list[Span]:
        """Spans that ended in ``(start, end]``, oldest first."""
        with self._lock:
            return self._ended_within(start, end)

    def _ended_within(self, start: float, end: float) -> list[Span]:
        found = []
        for span in reversed(self._spans):  # appended as they end: stop at the first that ended before
            if span.end <= start:
                break
            if span.end <= end:
                found.append(span)
        return found[::-1]


timeline = Timeline()
