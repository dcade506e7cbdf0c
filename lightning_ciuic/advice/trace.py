"""A run's timeline as a Chrome trace: the JSON that Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open.

Contract: :func:`chrome_trace` takes every rank's :data:`TraceEvent` list (index = global rank; as the
communication monitor gathers them and stores them in ``monitor.json`` under ``"trace"``) and returns the trace
object: one process per rank ("rank r"), one thread per track ("training", "dp collectives", "tp collectives",
"checkpoint writer", ...), a complete event (``"ph": "X"``, microseconds) per span, its category in ``cat``.
Timestamps are epoch seconds on input and microseconds since the earliest event on output. No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TraceEvent = tuple[str, str, str, float, float]  # (track, name, category, start in epoch seconds, duration in seconds)
_TRACK_ORDER = ("training", "pp stages", "dp collectives", "tp collectives", "pp collectives", "checkpoint writer")


def chrome_trace(events_by_rank: Sequence[Sequence[Sequence[Any]]]) -> dict[str, Any]:
    starts = [event[3] for events in events_by_rank for event in events]
    origin = min(starts) if starts else 0.0
    out: list[dict[str, Any]] = []
    for rank, events in enumerate(events_by_rank):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        tracks = sorted({event[0] for event in events}, key=lambda t: (_TRACK_ORDER.index(t) if t in _TRACK_ORDER else len(_TRACK_ORDER), t))
        tid = {track: i for i, track in enumerate(tracks)}
        for track, i in tid.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": track}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": i, "args": {"sort_index": i}})
        for track, name, category, start, duration in events:
            out.append({
                "ph": "X", "name": name, "cat": category, "pid": rank, "tid": tid[track],
                "ts": round((start - origin) * 1e6, 3), "dur": round(duration * 1e6, 3),
            })
    return {"traceEvents": out, "displayTimeUnit": "ms"}
