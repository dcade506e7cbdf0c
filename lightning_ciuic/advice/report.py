"""The monitor's outputs for people: a terminal summary table and a self-contained HTML report.

Contract: :func:`summary_table` and :func:`render_html` are pure functions of a
:class:`~lightning_ciuic.advice.RunProfile`, the gathered windows (``[{"step": int, "ranks": [dict]}]``) and
the advice. The HTML has no external resources (inline CSS and SVG): a step-time breakdown over time, a
per-rank heatmap of compute time per window, and the data-parallel bandwidth; then the per-rank table and
the advice. No Lightning imports.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from lightning_ciuic.advice.profile import RunProfile
from lightning_ciuic.advice.rules import Advice

_PARTS = (("compute", "#4e79a7"), ("dp_exposed", "#e15759"), ("data_wait", "#f28e2b"), ("other", "#bab0ac"))


def _breakdown(values: dict[str, float]) -> dict[str, float]:
    parts = {key: values[key] for key, _ in _PARTS if key != "other"}
    parts["other"] = max(0.0, values["step"] - sum(parts.values()))
    return parts


def bandwidth(profile: RunProfile) -> tuple[float, float]:
    """Data-parallel (algbw, busbw) in GB/s as nccl-tests define them, from the mean payload and comm time."""
    comm, payload = profile.mean("dp_comm"), profile.mean("dp_payload")
    if comm <= 0 or profile.dp < 2:
        return 0.0, 0.0
    algbw = payload / comm / 1e9
    return algbw, algbw * 2 * (profile.dp - 1) / profile.dp


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
    algbw, busbw = bandwidth(profile)
    lines.append(
        f"layout pp={profile.pp} x dp={profile.dp} x tp={profile.tp}, compression {profile.compression!r};"
        f" dp all-reduce algbw {algbw:.3f} GB/s, busbw {busbw:.3f} GB/s"
        + (f"; link measured {profile.bandwidth_bytes_per_s * 8 / 1e9:.2f} Gbit/s" if profile.bandwidth_bytes_per_s else "")
    )
    return "\n".join(lines)


def _svg_stacked(windows: Sequence[dict[str, Any]], width: int = 720, height: int = 220) -> str:
    if not windows:
        return "<p>No gathered windows.</p>"
    series = [_breakdown({k: sum(r[k] for r in w["ranks"]) / len(w["ranks"]) for k in w["ranks"][0]}) for w in windows]
    top = max(sum(s.values()) for s in series) or 1.0
    bar = width / len(series)
    rects = []
    for i, parts in enumerate(series):
        y = height
        for key, color in _PARTS:
            h = parts[key] / top * (height - 20)
            y -= h
            rects.append(
                f'<rect x="{i * bar:.1f}" y="{y:.1f}" width="{max(bar - 1, 1):.1f}" height="{h:.1f}" fill="{color}">'
                f"<title>step {windows[i]['step']}: {key} {parts[key] * 1e3:.1f} ms</title></rect>"
            )
    legend = "".join(
        f'<rect x="{10 + j * 130}" y="2" width="10" height="10" fill="{c}"/><text x="{24 + j * 130}" y="11">{k}</text>'
        for j, (k, c) in enumerate(_PARTS)
    )
    return f'<svg class="breakdown" width="{width}" height="{height}" font-size="11">{legend}{"".join(rects)}</svg>'


def _svg_heatmap(windows: Sequence[dict[str, Any]], width: int = 720, cell_h: int = 18) -> str:
    if not windows:
        return "<p>No gathered windows.</p>"
    n_ranks = len(windows[0]["ranks"])
    values = [[w["ranks"][r]["compute"] for w in windows] for r in range(n_ranks)]
    lo, hi = min(map(min, values)), max(map(max, values))
    cell_w = (width - 60) / len(windows)
    cells = []
    for r, row in enumerate(values):
        cells.append(f'<text x="0" y="{r * cell_h + 13}">rank {r}</text>')
        for i, value in enumerate(row):
            shade = 0.0 if hi == lo else (value - lo) / (hi - lo)
            color = f"rgb({int(255 * shade)},{int(80 + 100 * (1 - shade))},{int(200 * (1 - shade))})"
            cells.append(
                f'<rect x="{60 + i * cell_w:.1f}" y="{r * cell_h}" width="{max(cell_w - 1, 1):.1f}" height="{cell_h - 2}"'
                f' fill="{color}"><title>rank {r}, step {windows[i]["step"]}: compute {value * 1e3:.1f} ms</title></rect>'
            )
    return f'<svg class="heatmap" width="{width}" height="{n_ranks * cell_h}" font-size="11">{"".join(cells)}</svg>'


def _svg_bandwidth(profile: RunProfile, width: int = 480, height: int = 120) -> str:
    algbw, busbw = bandwidth(profile)
    link = (profile.bandwidth_bytes_per_s or 0.0) / 1e9
    bars = [("dp algbw", algbw), ("dp busbw", busbw), ("dp link (measured)", link)]
    top = max(v for _, v in bars) or 1.0
    items = []
    for i, (label, value) in enumerate(bars):
        w = value / top * (width - 200)
        items.append(
            f'<text x="0" y="{i * 34 + 18}">{label}</text><rect x="150" y="{i * 34 + 5}" width="{w:.1f}" height="20"'
            f' fill="#59a14f"/><text x="{155 + w:.1f}" y="{i * 34 + 19}">{value:.3f} GB/s</text>'
        )
    return f'<svg class="bandwidth" width="{width}" height="{height}" font-size="11">{"".join(items)}</svg>'


def render_html(profile: RunProfile, windows: Sequence[dict[str, Any]], advice: Sequence[Advice]) -> str:
    advice_html = (
        "".join(f"<li><b>{html.escape(a.summary)}</b><br><code>{html.escape(a.argument)}</code> — "
                f"{html.escape(a.prediction)}</li>" for a in advice)
        or "<li>None: nothing found that is predicted to gain 10% or more.</li>"
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>lightning_ciuic communication report</title>
<style>body{{font-family:sans-serif;max-width:780px;margin:2em auto}} pre{{font-size:11px;overflow-x:auto}}</style>
</head><body>
<h1>Communication report</h1>
<h2>Advice</h2><ul class="advice">{advice_html}</ul>
<h2>Step-time breakdown over time (mean of ranks, per gathered window)</h2>{_svg_stacked(windows)}
<h2>Compute time per rank (heatmap)</h2>{_svg_heatmap(windows)}
<h2>Bandwidth per axis</h2>{_svg_bandwidth(profile)}
<h2>Per rank</h2><pre>{html.escape(summary_table(profile))}</pre>
</body></html>
"""
