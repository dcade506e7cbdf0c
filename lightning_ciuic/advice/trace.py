"""A run's timeline as a Chrome trace: the JSON that Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open.

Contract: :func:`chrome_trace` takes every rank's :data:`TraceEvent` list (index = global rank; as the
communication monitor gathers them and stores them in ``monitor.json`` under ``"trace"``) and returns the trace
object: one process per rank ("rank r"), one thread per track ("training", "dp collectives", "tp collectives",
"checkpoint writer", ...), a complete event (``"ph": "X"``, microseconds) per span, its category in ``cat``.
Times are integer epoch nanoseconds on input (start, end) and integer microseconds since the earliest event on
output, each end and start floored from its own nanoseconds (``dur`` is the floored end minus the floored start):
a span that ended no later than the next one started ends no later than it starts in the trace, and a span
inside another stays inside it, exactly, which is what Perfetto needs to keep both (it drops a complete event
that overlaps the previous one on its track without nesting in it). Traces stored by earlier versions (epoch
seconds and a duration, as floats) still convert. No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TraceEvent = tuple[str, str, str, int, int]  # (track, name, category, start, end), in integer epoch nanoseconds
_TRACK_ORDER = ("training", "pp stages", "dp collectives", "tp collectives", "pp collectives", "checkpoint writer")


def _nanoseconds(event: Sequence[Any]) -> tuple[int, int]:
    """An event's (start, end) in integer epoch nanoseconds; a float start is the earlier format's epoch seconds
    with a duration in seconds."""
    start, end = event[3], event[4]
    if isinstance(start, float):
        return round(start * 1e9), round((start + end) * 1e9)
    return int(start), int(end)


def chrome_trace(events_by_rank: Sequence[Sequence[Sequence[Any]]]) -> dict[str, Any]:
    spans_by_rank = [[(*event[:3], *_nanoseconds(event)) for event in events] for events in events_by_rank]
    starts = [span[3] for spans in spans_by_rank for span in spans]
    origin = min(starts) // 1000 if starts else 0
    out: list[dict[str, Any]] = []
    for rank, spans in enumerate(spans_by_rank):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        tracks = sorted({span[0] for span in spans}, key=lambda t: (_TRACK_ORDER.index(t) if t in _TRACK_ORDER else len(_TRACK_ORDER), t))
        tid = {track: i for i, track in enumerate(tracks)}
        for track, i in tid.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": track}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": i, "args": {"sort_index": i}})
        for track, name, category, start, end in spans:
            ts = start // 1000 - origin
            out.append({
                "ph": "X", "name": name, "cat": category, "pid": rank, "tid": tid[track],
                "ts": ts, "dur": max(0, end // 1000 - origin - ts),
            })
    return {"traceEvents": out, "displayTimeUnit": "ms"}
