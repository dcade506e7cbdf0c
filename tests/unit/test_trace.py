"""The Chrome trace as Perfetto reads it: on every track, spans that ran one after the other do not overlap by even a
microsecond (Perfetto drops a complete event that overlaps the one before without nesting in it), spans that ran
inside another stay inside it, times are integers, and no span is lost on the way from the step records and the
timeline to ``trace.json``."""

import random
import threading
import time

import pytest

from lightning_ciuic.advice.trace import chrome_trace
from lightning_ciuic.callbacks import monitor as monitor_module
from lightning_ciuic.callbacks.monitor import CommunicationMonitor, step_events
from lightning_ciuic.telemetry import StepRecord
from lightning_ciuic.timeline import Timeline


def _traced_run(monkeypatch, steps=200, seed=3):
    """What the monitor holds after ``steps`` traced steps, built with the telemetry's arithmetic on
    ``time.perf_counter`` readings: each step's data wait starts where the previous step ended, minus a checkpoint
    staging on the training thread after every 10th step (it ran in the gap, after the other callbacks), a snapshot
    inside every 7th step's optimizer part, tensor-parallel collectives on their own track, and background writes."""
    rng = random.Random(seed)
    spans = Timeline()
    monkeypatch.setattr(monitor_module, "timeline", spans)
    monitor = CommunicationMonitor(trace=True, trace_steps=steps, measure_link=False)
    training = threading.current_thread().name
    last_end = time.perf_counter() - 100.0  # readings of this process's clock, all in the past
    nested = []
    for step in range(steps):
        stall = 0.0
        if step % 10 == 5:  # staging after the previous step's end, in the gap before this one
            staged = last_end + rng.uniform(5e-6, 5e-5)
            stall = rng.uniform(1e-3, 2e-2)
            spans.record("checkpoint staging", "checkpoint", staged, staged + stall, track=training)
            spans.record("checkpoint write", "checkpoint", staged + stall, staged + stall + 0.05, track="checkpoint writer")
        start = last_end + stall + rng.uniform(1e-4, 5e-3)
        grads_done = start + rng.uniform(1e-2, 0.3)
        for k in range(1, 4):  # one after another, as the collective timer records them
            launched = start + k * (grads_done - start) / 4
            spans.record("all_reduce", "tp", launched, launched + rng.uniform(1e-6, 1e-3), track="tp collectives")
        sync_mark = grads_done + rng.uniform(0.0, 2e-2)
        end = sync_mark + rng.uniform(1e-3, 5e-2)
        if step % 7 == 3:
            snap_start = rng.uniform(sync_mark, end)
            snap_end = rng.uniform(snap_start, end)
            spans.record("snapshot", "snapshot", snap_start, snap_end, track=training)
            nested.append(step)
        wait = start - last_end - stall  # Telemetry.end: the gap, less the stalls recorded in it
        record = StepRecord(step, step, 4, wait, grads_done - start, sync_mark - grads_done, end - start, True, start, {})
        monitor._trace_steps.append(step_events(record, rng.uniform(0.0, sync_mark - start)))
        last_end = end
    return monitor, nested


def _spans_by_track(trace):
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    tracks = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault(names[(e["pid"], e["tid"])], []).append(e)
    return tracks


def test_spans_one_after_another_never_overlap_and_nested_ones_stay_nested(monkeypatch):
    monitor, nested = _traced_run(monkeypatch)
    events = monitor._trace_events()
    trace = chrome_trace([events])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events)  # none lost on the way
    assert all(isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0 for e in spans)
    for track, found in _spans_by_track(trace).items():
        # What Perfetto checks: in start order (the longer first at a tie), each span ends before the next
        # starts, or holds it entirely.
        open_spans = []
        for e in sorted(found, key=lambda e: (e["ts"], -e["dur"])):
            while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= e["ts"]:
                open_spans.pop()
            if open_spans:
                outer = open_spans[-1]
                assert e["ts"] + e["dur"] <= outer["ts"] + outer["dur"], (track, outer, e)
            open_spans.append(e)

    training = _spans_by_track(trace)["training"]
    for step in range(len(monitor._trace_steps)):  # within a step, each part starts where the one before ended
        forward = next(e for e in training if e["name"] == f"step {step}: forward + backward")
        following = [e for e in training if e["ts"] == forward["ts"] + forward["dur"] and e["name"] in ("dp sync (exposed)", "optimizer step + callbacks")]
        assert following, (step, forward)
    snapshots = [e for e in training if e["name"] == "snapshot"]
    optimizer = [e for e in training if e["name"] == "optimizer step + callbacks"]
    assert len(snapshots) == len(nested)
    for snapshot in snapshots:  # inside its step's optimizer part
        assert any(o["ts"] <= snapshot["ts"] and snapshot["ts"] + snapshot["dur"] <= o["ts"] + o["dur"] for o in optimizer)
    stagings = [e for e in training if e["name"] == "checkpoint staging"]
    waits = [e for e in training if e["name"] == "data wait"]
    for staging in stagings:  # the next step's data wait is drawn after the staging, not over it
        assert any(w["ts"] == staging["ts"] + staging["dur"] for w in waits), staging


def test_a_write_still_running_when_training_ends_is_in_the_trace_cut_at_its_end(monkeypatch):
    """The monitor gathers the trace before the checkpoint callbacks wait for their write: a write running on its
    own thread then is drawn from its start to the trace's end, under its own name; once it ends it is the plain
    span, and the running list is empty."""
    monitor, _ = _traced_run(monkeypatch, steps=20)
    spans = monitor_module.timeline
    started, release = threading.Event(), threading.Event()

    def write():
        with spans.span("checkpoint write", "checkpoint", track="checkpoint writer"):
            started.set()
            release.wait()

    writer = threading.Thread(target=write)
    writer.start()
    started.wait()
    events = monitor._trace_events()
    running = [e for e in events if e[1] == "checkpoint write (running at train end)"]
    assert len(running) == 1 and running[0][0] == "checkpoint writer" and running[0][3] < running[0][4]
    assert running[0][4] >= max(e[4] for e in events if e is not running[0])  # cut at the trace's end
    assert len(spans.running()) == 1
    release.set()
    writer.join()
    assert spans.running() == []
    events = monitor._trace_events()
    assert not any(e[1].endswith("(running at train end)") for e in events)
    assert sum(e[1] == "checkpoint write" for e in events) == 2 + 1  # the two of _traced_run's 20 steps, and this one


def test_times_are_microseconds_from_the_earliest_span():
    ns = 1_700_000_000_123_456_789
    events = [[("training", "a", "compute", ns, ns + 2_500), ("training", "b", "compute", ns + 2_500, ns + 10_999)],
              [("training", "c", "compute", ns + 1_000_000, ns + 3_000_000)]]
    spans = {e["name"]: (e["ts"], e["dur"]) for e in chrome_trace(events)["traceEvents"] if e["ph"] == "X"}
    assert spans == {"a": (0, 3), "b": (3, 8), "c": (1000, 2000)}  # floor of each end, not a rounded duration


def test_a_trace_stored_in_seconds_by_an_earlier_version_still_opens():
    legacy = [[("training", "step 5: forward + backward", "compute", 1000.0, 0.3),
               ("checkpoint writer", "checkpoint write", "checkpoint", 1000.47, 0.2)]]
    spans = {e["name"]: e for e in chrome_trace(legacy)["traceEvents"] if e["ph"] == "X"}
    assert spans["step 5: forward + backward"]["ts"] == 0
    assert spans["checkpoint write"]["ts"] == pytest.approx(470_000, abs=1)
    assert spans["checkpoint write"]["dur"] == pytest.approx(200_000, abs=1)
