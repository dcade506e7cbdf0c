"""The monitor's report and trace from a recorded run: every part of the step is drawn with axes, units, step
numbers and a legend; the tables are tables; the advice says what was checked; every rate is in one unit (GB/s) in
the page, the terminal table and the advice; the dp sync's throughput is called what it is (bytes per second of a
window that includes the overlapped backward), not a bandwidth; `lightning-ciuic report` writes both files again
from monitor.json; the Chrome trace has one process per rank and a track per kind of work."""

import json
import re
from html.parser import HTMLParser

import pytest

from lightning_ciuic.advice import RANK_FIELDS, RunProfile, check
from lightning_ciuic.advice.profile import format_rate
from lightning_ciuic.advice.report import _PARTS, breakdown, render_html, summary_table, throughput
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
    assert "per link = effective" in text and "measured at start: 0.900 GB/s" in text  # throughput explained, the link
    assert page.rows["ranks"] == 1 + 4 and page.rows["parts"] == 1 + len(_PARTS) + 1
    assert page.rows["checks"] == 1 + 7  # every rule, with what it checked
    assert "not checked: no mixture-of-experts layer" in text
    assert "not checked: no pipeline parallelism" in text and "(advised from 1.15x)" in text


def _page_text(profile, windows=()):
    page = _Page()
    page.feed(render_html(profile, list(windows), check(profile)))
    return " ".join(page.text)


# a number followed by a rate unit (bytes or bits, any prefix, per second)
_RATE = re.compile(r"(\d[\d.,]*)\s*((?:[kKMGT]i?)?(?:B|bit|b)/s|(?:[kKMGT]i?)?bps)\b")


def test_one_unit_for_every_rate_in_the_console_the_page_and_the_advice():
    record = recorded_run()
    profile = RunProfile.from_json(record["profile"])
    console, page = summary_table(profile), _page_text(profile, record["windows"])
    for text in (console, page):
        assert {unit for _, unit in _RATE.findall(text)} == {"GB/s"}, _RATE.findall(text)
        assert format_rate(9e8) == "0.900 GB/s" and "0.900 GB/s" in text  # the measured link, written the same way

    # a sync-bound run on a 1 Gbit/s link: the compression advice gives its rate in the same unit
    ranks = [dict(_rank(), step=0.47, compute=0.15, tp_comm=0.0, pp_bubble=0.0, dp_comm=0.32, dp_exposed=0.30,
                  dp_payload=4e7, dp_bytes=4e7) for _ in range(2)]
    slow = RunProfile(world_size=2, dp=2, gradient_numel=10_000_000, buckets=2, latency_s=1e-4, bandwidth_bytes_per_s=1.25e8,
                      codec_s_per_value={"none": 0.0, "fp16": 2e-9, "int8": 8e-9, "nf4": 3e-8}, ranks=ranks)
    advice = [f.advice.summary for f in check(slow) if f.advice is not None]
    assert any("GB/s" in a for a in advice), advice
    for text in (*advice, summary_table(slow), _page_text(slow)):
        assert {unit for _, unit in _RATE.findall(text)} <= {"GB/s"}, text


def test_the_dp_sync_throughput_is_bytes_per_second_of_its_window_and_says_so():
    """dp_comm runs from the first bucket launched to the last reduced, overlapped backward included: payload over it
    is an effective throughput (a lower bound of the all-reduce's bandwidth), and neither output calls it algbw/busbw."""
    profile = RunProfile.from_json(recorded_run()["profile"])  # 4 MB reduced in a 120 ms window, 30 ms of it exposed
    effective, per_link = throughput(profile)
    assert effective == pytest.approx(4e6 / 0.120) and per_link == pytest.approx(effective * 2 * (2 - 1) / 2)
    console, page = summary_table(profile), _page_text(profile, recorded_run()["windows"])
    assert f"dp sync effective throughput {format_rate(effective)}, per link {format_rate(per_link)}" in console
    assert "overlapped backward included: not the link's bandwidth" in console
    assert f"effective throughput = gradient bytes reduced / sync window ({format_rate(effective)})" in page
    assert "includes the backward the sync overlaps (75% of it hidden behind backward here)" in page
    assert "not the all-reduce's bandwidth" in page
    for text in (console, page):
        assert "algbw =" not in text and "busbw =" not in text and "all-reduce algbw" not in text
    assert throughput(RunProfile(world_size=1, dp=1, ranks=[_rank()])) == (0.0, 0.0)  # no data parallelism


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
