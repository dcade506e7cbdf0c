"""The monitor's outputs for people: a terminal summary table and a self-contained HTML report.

Contract: :func:`summary_table` and :func:`render_html` are pure functions of a
:class:`~lightning_ciuic.advice.RunProfile`, the gathered windows (``[{"step": int, "ranks": [dict]}]``) and
the rules' findings. The HTML is one file with no external resources (inline CSS and SVG): the advice and what
every rule checked; the step's breakdown per part (compute, tp comm, pp bubble, exposed dp sync, DiLoCo outer
sync, data wait, checkpoint and snapshot stalls, other) over the gathered windows, with axes in ms and training
steps and a legend, and as a table; compute per rank and window as a heatmap with its scale; the data-parallel
sync's effective throughput (:func:`throughput`) beside the link measured at start, with what it is and is not; the
per-rank table. :func:`write_report` writes it (and the Chrome trace) from a ``monitor.json`` record. Every rate,
in the page and in :func:`summary_table` alike, is written by :func:`~lightning_ciuic.advice.profile.format_rate`
(GB/s). No Lightning imports.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_ciuic.advice.profile import RunProfile, format_rate
from lightning_ciuic.advice.rules import Finding, check
from lightning_ciuic.advice.trace import chrome_trace

# The step's parts, in stacking order: (field or derived key, label, colour). "compute" is forward + backward less the
# tensor-parallel collectives and the pipeline bubble inside it; "other" is what the step took beyond all parts.
_PARTS = (
    ("compute", "compute", "#4e79a7"),
    ("tp_comm", "tp comm", "#76b7b2"),
    ("pp_bubble", "pp bubble", "#b07aa1"),
    ("dp_exposed", "dp sync (exposed)", "#e15759"),
    ("outer_sync", "DiLoCo outer sync", "#ff9da7"),
    ("data_wait", "data wait", "#f28e2b"),
    ("checkpoint_stall", "checkpoint stall", "#9c755f"),
    ("snapshot_stall", "snapshot stall", "#edc948"),
    ("other", "other (optimizer, callbacks)", "#bab0ac"),
)


def breakdown(values: dict[str, float]) -> dict[str, float]:
    """Seconds per part of :data:`_PARTS` of one rank's (or a mean) step; the parts add up to ``step``."""
    get = lambda key: float(values.get(key, 0.0))  # noqa: E731 - monitor.json of earlier versions lacks fields
    parts = {"compute": max(0.0, get("compute") - get("tp_comm") - get("pp_bubble"))}
    parts.update({key: get(key) for key, _, _ in _PARTS[1:-1]})
    parts["other"] = max(0.0, get("step") - sum(parts.values()))
    return parts


def _mean_ranks(ranks: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*ranks) if ranks else set()
    return {k: sum(r.get(k, 0.0) for r in ranks) / len(ranks) for k in keys}


def throughput(profile: RunProfile) -> tuple[float, float]:
    """The data-parallel sync's effective throughput, in bytes per second: (gradient bytes reduced per second of the
    sync window, the same x 2(n-1)/n: what each rank's link carried per second of it), from the rank means of
    ``dp_payload`` and ``dp_comm``. The window runs from the first gradient bucket launched to the last one reduced,
    so it includes the backward the sync overlaps: these are not nccl-tests' algbw and busbw (bytes over the
    collectives' own time) but lower bounds of them, equal only where nothing overlaps. (0, 0) without dp."""
    comm, payload = profile.mean("dp_comm"), profile.mean("dp_payload")
    if comm <= 0 or profile.dp < 2:
        return 0.0, 0.0
    effective = payload / comm
    return effective, effective * 2 * (profile.dp - 1) / profile.dp


def _hidden(exposed: float, comm: float) -> str:
    """The share of the expert all-to-alls' wall time the training thread did not wait for."""
    return f"{max(0.0, 1 - exposed / comm):.0%}" if comm > 0 else "0%"


def summary_table(profile: RunProfile) -> str:
    header = "rank | step ms | compute ms | dp exposed ms | dp comm ms | tp comm ms | data ms | straggler wait ms | MB sent | overlap | memory MB"
    slowest = max((r["compute"] for r in profile.ranks), default=0.0)
    lines = [header, "-" * len(header)]
    for rank, r in enumerate(profile.ranks):
        overlap = 1 - r["dp_exposed"] / r["dp_comm"] if r["dp_comm"] > 0 else 0.0
        lines.append(
            f"{rank:4d} | {r['step'] * 1e3:7.1f} | {r['compute'] * 1e3:10.1f} | {r['dp_exposed'] * 1e3:13.1f} |"
            f" {r['dp_comm'] * 1e3:10.1f} | {r['tp_comm'] * 1e3:10.1f} | {r['data_wait'] * 1e3:7.1f} |"
            f" {(slowest - r['compute']) * 1e3:17.1f} | {r['dp_bytes'] / 1e6:7.2f} | {max(0.0, overlap):7.0%} | {r['memory_mb']:9.0f}"
        )
    if profile.dp_shard > 1:
        lines.append(
            f"sharded over dp_shard={profile.dp_shard}: parameter all-gathers {profile.mean('dp_gather') * 1e3:.1f} ms,"
            f" gradient reduce-scatters {profile.mean('dp_scatter') * 1e3:.1f} ms per step (rank mean; in dp comm)"
        )
    if profile.ep > 1 or profile.expert_load:
        tokens = [r["ep_tokens"] for r in profile.ranks]
        spread = f"{min(tokens):.0f}-{max(tokens):.0f}" if tokens else "0"
        load = ", ".join(f"{layer} {ratio:.2f}" for layer, ratio in profile.expert_load.items())
        lines.append(
            f"experts (ep={profile.ep}): tokens per expert max/mean over the run: {load or 'none routed'};"
            f" tokens each rank's experts ran per step {spread}; all-to-all {profile.mean('ep_bytes') / 1e6:.2f} MB sent"
            f" and {profile.mean('ep_comm') * 1e3:.1f} ms per step, {profile.mean('ep_exposed') * 1e3:.1f} ms of it exposed"
            f" ({_hidden(profile.mean('ep_exposed'), profile.mean('ep_comm'))} hidden behind compute; rank mean)"
        )
    effective, per_link = throughput(profile)
    lines.append(
        f"layout pp={profile.pp} x dp={profile.dp} x tp={profile.tp}, compression {profile.compression!r};"
        f" dp sync effective throughput {format_rate(effective)}, per link {format_rate(per_link)}"
        " (gradient bytes / sync window, overlapped backward included: not the link's bandwidth)"
        + (f"; link measured at start {format_rate(profile.bandwidth_bytes_per_s)}" if profile.bandwidth_bytes_per_s else "")
    )
    return "\n".join(lines)


def _nice_step(top: float, ticks: int = 4) -> float:
    raw = top / ticks
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)


def _legend(items: Sequence[tuple[str, str]], x0: float, y0: float, per_row: int, col_w: float) -> str:
    return "".join(
        f'<rect x="{x0 + (j % per_row) * col_w:.0f}" y="{y0 + (j // per_row) * 16:.0f}" width="10" height="10" fill="{color}"/>'
        f'<text x="{x0 + (j % per_row) * col_w + 14:.0f}" y="{y0 + (j // per_row) * 16 + 9:.0f}">{html.escape(label)}</text>'
        for j, (label, color) in enumerate(items)
    )


def _x_labels(steps: Sequence[int], x0: float, slot: float, y: float) -> str:
    every = max(1, math.ceil(len(steps) / 12))  # at most about 12 labels
    return "".join(
        f'<text x="{x0 + (i + 0.5) * slot:.1f}" y="{y:.0f}" text-anchor="middle">{step}</text>'
        for i, step in enumerate(steps) if i % every == 0
    )


def _svg_breakdown(windows: Sequence[dict[str, Any]], width: int = 760, height: int = 300) -> str:
    """Stacked bars: the mean step of the ranks in each gathered window, by part, in milliseconds."""
    if not windows:
        return "<p>No gathered windows (the run was shorter than the monitor's gather_every).</p>"
    series = [breakdown(_mean_ranks(w["ranks"])) for w in windows]
    left, top_margin, bottom = 56, 44, 40
    plot_w, plot_h = width - left - 10, height - top_margin - bottom
    top = max(sum(s.values()) for s in series) * 1e3 or 1.0
    tick = _nice_step(top)
    top = math.ceil(top / tick) * tick
    slot = plot_w / len(series)
    out = [_legend([(label, color) for _, label, color in _PARTS], left, 2, 5, 140)]
    for i in range(int(round(top / tick)) + 1):  # y axis: gridlines and labels
        y = top_margin + plot_h - i * tick / top * plot_h
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{i * tick:g}</text>')
    for i, parts in enumerate(series):
        y = top_margin + plot_h
        for key, label, color in _PARTS:
            h = parts[key] * 1e3 / top * plot_h
            y -= h
            out.append(
                f'<rect x="{left + i * slot + 1:.1f}" y="{y:.1f}" width="{max(slot - 2, 1):.1f}" height="{h:.1f}" fill="{color}">'
                f"<title>steps to {windows[i]['step']}: {label} {parts[key] * 1e3:.1f} ms</title></rect>"
            )
    out.append(f'<line x1="{left}" x2="{left}" y1="{top_margin}" y2="{top_margin + plot_h}" stroke="#333"/>')
    out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{top_margin + plot_h}" y2="{top_margin + plot_h}" stroke="#333"/>')
    out.append(_x_labels([w["step"] for w in windows], left, slot, top_margin + plot_h + 14))
    out.append(f'<text x="{left + plot_w / 2:.0f}" y="{height - 4}" text-anchor="middle">training step (end of each gathered window)</text>')
    out.append(f'<text transform="translate(12,{top_margin + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">ms per step (mean of ranks)</text>')
    return f'<svg class="chart breakdown" width="{width}" height="{height}" font-size="11">{"".join(out)}</svg>'


def _color(shade: float) -> str:
    return f"rgb({int(40 + 215 * shade)},{int(90 + 80 * (1 - shade))},{int(60 + 160 * (1 - shade))})"


def _svg_heatmap(windows: Sequence[dict[str, Any]], width: int = 760, cell_h: int = 20) -> str:
    """Compute time per rank (rows) and gathered window (columns), with its colour scale in milliseconds."""
    if not windows:
        return "<p>No gathered windows.</p>"
    n_ranks = len(windows[0]["ranks"])
    values = [[w["ranks"][r]["compute"] * 1e3 for w in windows] for r in range(n_ranks)]
    lo, hi = min(map(min, values)), max(map(max, values))
    left, scale_h = 60, 46
    plot_w = width - left - 10
    cell_w = plot_w / len(windows)
    out = []
    for r, row in enumerate(values):
        out.append(f'<text x="0" y="{r * cell_h + 14}">rank {r}</text>')
        for i, value in enumerate(row):
            shade = 0.0 if hi == lo else (value - lo) / (hi - lo)
            out.append(
                f'<rect x="{left + i * cell_w:.1f}" y="{r * cell_h}" width="{max(cell_w - 1, 1):.1f}" height="{cell_h - 2}"'
                f' fill="{_color(shade)}"><title>rank {r}, steps to {windows[i]["step"]}: compute {value:.1f} ms</title></rect>'
            )
    y = n_ranks * cell_h
    out.append(_x_labels([w["step"] for w in windows], left, cell_w, y + 12))
    gradient = "".join(f'<stop offset="{k / 10:.1f}" stop-color="{_color(k / 10)}"/>' for k in range(11))
    out.append(f'<defs><linearGradient id="scale">{gradient}</linearGradient></defs>'
               f'<rect x="{left}" y="{y + 22}" width="200" height="10" fill="url(#scale)"/>'
               f'<text x="{left - 4}" y="{y + 31}" text-anchor="end">{lo:.1f} ms</text>'
               f'<text x="{left + 204}" y="{y + 31}">{hi:.1f} ms compute per step (training step on the axis above)</text>')
    return f'<svg class="chart heatmap" width="{width}" height="{y + scale_h}" font-size="11">{"".join(out)}</svg>'


def _svg_bandwidth(profile: RunProfile, width: int = 760) -> str:
    """Horizontal bars, labelled by :func:`format_rate`: the dp sync's effective throughput (and per link) beside
    the link measured at start."""
    effective, per_link = throughput(profile)
    link = profile.bandwidth_bytes_per_s or 0.0
    bars = [("dp sync, effective", effective, "#59a14f"), ("dp sync, effective per link", per_link, "#4e79a7")]
    if link:
        bars.append(("dp link, measured at start", link, "#bab0ac"))
    top = max(v for _, v, _ in bars) or 1.0
    label_w, value_w = 190, 90
    out = []
    for i, (label, value, color) in enumerate(bars):
        w = value / top * (width - label_w - value_w)
        out.append(f'<text x="0" y="{i * 28 + 17}">{label}</text>'
                   f'<rect x="{label_w}" y="{i * 28 + 4}" width="{max(w, 1):.1f}" height="18" fill="{color}"/>'
                   f'<text x="{label_w + w + 6:.1f}" y="{i * 28 + 17}">{format_rate(value)}</text>')
    return f'<svg class="chart bandwidth" width="{width}" height="{len(bars) * 28 + 6}" font-size="11">{"".join(out)}</svg>'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _rank_rows(profile: RunProfile) -> list[list[str]]:
    slowest = max((r["compute"] for r in profile.ranks), default=0.0)
    rows = []
    for rank, r in enumerate(profile.ranks):
        overlap = 1 - r["dp_exposed"] / r["dp_comm"] if r["dp_comm"] > 0 else 0.0
        rows.append([
            str(rank), f"{r['step'] * 1e3:.1f}", f"{r['compute'] * 1e3:.1f}", f"{r['tp_comm'] * 1e3:.1f}",
            f"{r['dp_comm'] * 1e3:.1f}", f"{r['dp_exposed'] * 1e3:.1f}", f"{max(0.0, overlap):.0%}",
            f"{r['data_wait'] * 1e3:.1f}", f"{(r['checkpoint_stall'] + r['snapshot_stall']) * 1e3:.1f}",
            f"{(slowest - r['compute']) * 1e3:.1f}", f"{r['dp_bytes'] / 1e6:.2f}", f"{r['memory_mb']:.0f}",
        ])
    return rows


def render_html(profile: RunProfile, windows: Sequence[dict[str, Any]], findings: Sequence[Finding]) -> str:
    """The report page; ``findings`` from :func:`lightning_ciuic.advice.check`."""
    advice = [f.advice for f in findings if f.advice is not None]
    advice_html = "".join(
        f"<li><b>{html.escape(a.summary)}</b><br>change: <code>{html.escape(a.argument)}</code> ({html.escape(a.prediction)})</li>"
        for a in sorted(advice, key=lambda a: -a.predicted_speedup)
    ) or "<li>None: no rule found a change predicted to gain 10% or more (see what was checked below).</li>"
    checked = _table(["rule", "what was checked", "advice"],
                     [[f.rule, f.checked, "yes" if f.advice else "no"] for f in findings], "checks")
    mean = breakdown(_mean_ranks(profile.ranks))
    step = sum(mean.values()) or 1.0
    parts = _table(["part", "ms per step", "share of the step"],
                   [[label, f"{mean[key] * 1e3:.1f}", f"{mean[key] / step:.0%}"] for key, label, _ in _PARTS] +
                   [["step (all parts)", f"{step * 1e3:.1f}", "100%"]], "parts")
    ranks = _table(["rank", "step ms", "compute ms", "tp comm ms", "dp comm ms", "dp exposed ms", "overlap", "data wait ms",
                    "ckpt + snapshot ms", "straggler wait ms", "MB sent", "memory MB"], _rank_rows(profile), "ranks")
    effective, per_link = throughput(profile)
    link = profile.bandwidth_bytes_per_s
    comm, exposed = profile.mean("dp_comm"), profile.mean("dp_exposed")
    overlap = max(0.0, 1 - exposed / comm) if comm > 0 else 0.0
    sharded = (f" Sharded over dp_shard={profile.dp_shard}: parameter all-gathers {profile.mean('dp_gather') * 1e3:.1f} ms and"
               f" gradient reduce-scatters {profile.mean('dp_scatter') * 1e3:.1f} ms per step (in dp comm)." if profile.dp_shard > 1 else "")
    steps = f"steps {windows[0]['step']} to {windows[-1]['step']}" if windows else "no gathered window"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>lightning_ciuic communication report</title>
<style>
body{{font-family:sans-serif;max-width:800px;margin:2em auto;color:#222}} h2{{margin-top:1.6em}}
table{{border-collapse:collapse;font-size:12px;margin:.5em 0}} th,td{{border:1px solid #ccc;padding:3px 6px;text-align:right}}
th{{background:#f3f3f3}} td:first-child,th:first-child{{text-align:left}} table.checks td,table.checks th{{text-align:left}}
table.ranks{{width:100%}} .note{{font-size:12px;color:#555}} code{{font-size:12px}}
</style>
</head><body>
<h1>Communication report</h1>
<p>Layout pp={profile.pp} x dp={profile.dp} x tp={profile.tp} ({profile.world_size} ranks), gradient compression
{html.escape(profile.compression)!s}; per-rank means over the run (the first steps left out), charts per gathered window ({steps}).</p>
<h2>Advice</h2><ul class="advice">{advice_html}</ul>
<h3>What was checked</h3>{checked}
<h2>Where a step's time goes</h2>{_svg_breakdown(windows)}
{parts}
<p class="note">compute = forward + backward less the tensor-parallel collectives (timed on sampled steps) and the pipeline
bubble inside it; dp sync (exposed) = gradient synchronization left after backward; stalls = training stopped while a
checkpoint was staged or a snapshot taken.</p>
<h2>Compute time per rank</h2>{_svg_heatmap(windows)}
<h2>Data-parallel sync throughput</h2>{_svg_bandwidth(profile)}
<p class="note">effective throughput = gradient bytes reduced / sync window ({format_rate(effective)}); per link = effective
throughput x 2(n-1)/n with n = dp = {profile.dp} ({format_rate(per_link)}): what each rank's link carried per second of the
window. The window (dp comm, {comm * 1e3:.1f} ms) runs from the first gradient bucket launched to the last one reduced,
so it includes the backward the sync overlaps ({overlap:.0%} of it hidden behind backward here): these are bytes per
second of that window, not the all-reduce's bandwidth (nccl-tests' algbw and busbw divide by the collectives' own
time, which the monitor does not see), and lower than it wherever the link sat idle in the window, waiting for
backward to produce the next bucket.
{f"The link, measured at start: {format_rate(link)}." if link else "The link was not measured (measure_link=False)."} Far below the
link is expected when the sync overlaps backward (hidden sync costs nothing: the exposed part above is what the step
pays); with little overlap it means latency, the codec or waiting for slower ranks, not the wire, limits the sync.{sharded}</p>
<h2>Per rank</h2>{ranks}
</body></html>
"""


def write_report(out: Path, record: dict[str, Any]) -> dict[str, Path]:
    """Write ``report.html`` (and ``trace.json`` when ``record`` has a trace) into ``out`` from a ``monitor.json``
    record; returns what was written, by kind."""
    profile = RunProfile.from_json(record["profile"])
    written = {"report": out / "report.html"}
    written["report"].write_text(render_html(profile, record.get("windows", []), check(profile)))
    if record.get("trace"):
        written["trace"] = out / "trace.json"
        written["trace"].write_text(json.dumps(chrome_trace(record["trace"])))
    return written
