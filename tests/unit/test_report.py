"""The monitor's report and trace from a recorded run: every part of the step is drawn with axes, units, step
numbers and a legend; the tables are tables; the advice says what was checked; `lightning-ciuic report` writes
both files again from monitor.json; the Chrome trace has one process per rank and a track per kind of work."""

import json
from html.parser import HTMLParser

import pytest

from lightning_ciuic.advice import RANK_FIELDS, RunProfile, check
from lightning_ciuic.advice.report import _PARTS, breakdown, render_html
from lightning_ciuic.advice.trace import chrome_trace
from lightning_ciuic.cli import main as cli_main

MS = 1e-3


def _rank(compute=300 * MS, **values):
    base = dict.fromkeys(RANK_FIELDS, 0.0)
    base.update(step=560 * MS, compute=compute, tp_comm=90 * MS, pp_bubble=40 * MS, dp_exposed=30 * MS, dp_comm=120 * MS,
                outer_sync=20 * MS, data_wait=25 * MS, checkpoint_stall=15 * MS, snapshot_stall=10 * MS,
                dp_payload=4e6, dp_bytes=4e6, memory_mb=600.0)
    base.update(values)
    return base


def recorded_run(n_windows=10, ranks=4):
    """A monitor.json record as a dp 2 x tp 2 run writes it, with a trace of two steps per rank."""
    profile = RunProfile(world_size=ranks, dp=2, tp=2, gradient_numel=800_000, buckets=1, latency_s=1e-4,
                         bandwidth_bytes_per_s=9e8, ranks=[_rank(300 * MS + r * 10 * MS) for r in range(ranks)],
                         dp_rank_of=[0, 0, 1, 1], memory_capacity_mb=6000.0)
    windows = [{"step": 20 * (i + 1), "ranks": [_rank(300 * MS + 5 * MS * ((i + r) % 4)) for r in range(ranks)]}
               for i in range(n_windows)]
    trace = [[("training", "step 5: forward + backward", "compute", 1000.0 + r * 1e-3, 0.3),
              ("dp collectives", "gradient synchronization", "dp", 1000.2, 0.12),
              ("tp collectives", "all_reduce", "tp", 1000.05, 0.01),
              ("training", "checkpoint staging", "checkpoint", 1000.45, 0.015),
              ("checkpoint writer", "checkpoint write", "checkpoint", 1000.47, 0.2)] for r in range(ranks)]
    return {"profile": profile.to_json(), "windows": windows, "trace": trace}


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.svgs, self.tables, self.rows, self.text, self._table = [], [], {}, [], None

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class")
        if tag == "svg":
            self.svgs.append(cls)
        if tag == "table":
            self.tables.append(cls)
            self._table = cls
            self.rows[cls] = 0
        if tag == "tr" and self._table:
            self.rows[self._table] += 1

    def handle_data(self, data):
        self.text.append(data)


def test_the_breakdown_parts_add_up_to_the_step():
    parts = breakdown(_rank())
    assert set(parts) == {key for key, _, _ in _PARTS}
    assert sum(parts.values()) == pytest.approx(560 * MS)
    assert parts["compute"] == pytest.approx(300 * MS - 90 * MS - 40 * MS)  # tp comm and the bubble are inside compute
    assert parts["other"] == pytest.approx(560 * MS - 170 * MS - 90 * MS - 40 * MS - 30 * MS - 20 * MS - 25 * MS - 25 * MS)


def test_the_report_draws_every_part_with_axes_legend_scale_and_real_tables():
    record = recorded_run()
    profile = RunProfile.from_json(record["profile"])
    page = _Page()
    page.feed(render_html(profile, record["windows"], check(profile)))
    text = " ".join(page.text)
    assert page.svgs == ["chart breakdown", "chart heatmap", "chart bandwidth"]
    for _, label, _ in _PARTS:  # legend and parts table
        assert text.count(label) >= 2, label
    assert "ms per step (mean of ranks)" in text and "training step (end of each gathered window)" in text
    assert all(str(w["step"]) in text for w in record["windows"])  # x axis: step numbers
    assert "ms compute per step" in text  # the heatmap's scale
    assert "busbw = algbw x 2(n-1)/n" in text and "7.20 Gbit/s" in text  # bandwidth explained, link in both units
    assert page.rows["ranks"] == 1 + 4 and page.rows["parts"] == 1 + len(_PARTS) + 1
    assert page.rows["checks"] == 1 + 6  # every rule, with what it checked
    assert "not checked: no pipeline parallelism" in text and "(advised from 1.15x)" in text


def test_report_command_writes_the_page_and_the_trace_again(tmp_path, capsys):
    run = tmp_path / "run" / "monitor"
    run.mkdir(parents=True)
    (run / "monitor.json").write_text(json.dumps(recorded_run()))
    with pytest.raises(SystemExit) as done:
        cli_main(["report", str(tmp_path)])
    assert done.value.code == 0
    assert "Communication report" in (run / "report.html").read_text()
    trace = json.loads((run / "trace.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {"checkpoint write", "all_reduce"}
    assert str(run / "trace.json") in capsys.readouterr().out
    with pytest.raises(SystemExit) as missing:
        cli_main(["report", str(tmp_path / "nowhere")])
    assert missing.value.code == 2


def test_chrome_trace_has_a_process_per_rank_and_a_track_per_kind_of_work():
    trace = chrome_trace(recorded_run(ranks=2)["trace"])
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {t for _, t in tracks} == {"training", "dp collectives", "tp collectives", "checkpoint writer"}
    spans = [e for e in events if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0.0  # microseconds from the earliest span
    write = next(e for e in spans if e["name"] == "checkpoint write" and e["pid"] == 1)
    assert write["dur"] == pytest.approx(0.2e6) and write["ts"] == pytest.approx(0.47e6)
    tid = {(e["pid"], e["args"]["name"]): e["tid"] for e in events if e["name"] == "thread_name"}
    assert write["tid"] == tid[(1, "checkpoint writer")] != tid[(1, "training")]
