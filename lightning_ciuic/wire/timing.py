"""Seconds between two moments of a device's work, without making the host wait for the device.

Contract of ``DeviceClock(device)``: ``mark()`` notes the present moment of the work queued so far; on the CPU
that is the host clock, on a CUDA device an event recorded on the current stream (the host only queued the
work, so its own clock would time the queueing). ``add(start, end, sink)`` hands ``end - start`` in seconds to
``sink``: at once on the CPU; on CUDA as soon as the end event has completed, checked without blocking at each
later ``add``/``collect()``, or waited for by ``collect(wait=True)``. Figures read from the sinks may lag the
device by a step; nothing on the training path synchronizes the host with the device.

No Lightning imports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Union

import torch

Moment = Union[float, "torch.cuda.Event"]


class DeviceClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._pending: list[tuple[Moment, Moment, Callable[[float], None]]] = []

    def mark(self) -> Moment:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: Moment, end: Moment, sink: Callable[[float], None]) -> None:
        if not self.cuda:
            sink(float(end) - float(start))
            return
        self._pending.append((start, end, sink))
        self.collect()

    def collect(self, wait: bool = False) -> None:
        """Hand over every interval whose end has completed (all of them with ``wait``)."""
        waiting = []
        for start, end, sink in self._pending:
            if wait:
                end.synchronize()
            if end.query():
                sink(start.elapsed_time(end) / 1e3)  # milliseconds
            else:
                waiting.append((start, end, sink))
        self._pending = waiting
