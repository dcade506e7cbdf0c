"""The report in a real browser (headless Chromium): the text a person reads is on the page, and every chart's area
in a screenshot is drawn, not blank."""

import json

import pytest

from lightning_ciuic.advice.report import write_report
from lightning_ciuic.testing.browser import find_chromium, probe, screenshot
from tests.unit.test_report import recorded_run

pytestmark = pytest.mark.skipif(
    find_chromium() is None, reason="no headless Chromium (make test installs Debian's chromium where apt can)"
)


def test_report_renders_its_text_and_non_blank_charts_in_chromium(tmp_path):
    from PIL import Image

    record = recorded_run()
    (tmp_path / "monitor.json").write_text(json.dumps(record))
    page = write_report(tmp_path, record)["report"]

    seen = probe(page, "svg.chart")
    for text in ("Communication report", "What was checked", "Where a step's time goes", "ms per step (mean of ranks)",
                 "training step (end of each gathered window)", "dp sync (exposed)", "checkpoint stall", "effective throughput",
                 "Per rank", "straggler wait ms"):
        assert text in seen["text"], text
    charts = {box["cls"]: box for box in seen["boxes"]}
    assert set(charts) == {"chart breakdown", "chart heatmap", "chart bandwidth"}
    assert all(box["width"] > 400 and box["height"] > 60 for box in charts.values())
    assert max(box["x"] + box["width"] for box in charts.values()) <= 900  # nothing runs off the page sideways

    image = Image.open(screenshot(page, tmp_path / "report.png", height=int(seen["height"]))).convert("RGB")
    assert image.size == (900, int(seen["height"]))
    for cls, box in charts.items():
        area = image.crop((int(box["x"]), int(box["y"]), int(box["x"] + box["width"]), int(box["y"] + box["height"])))
        colours = area.getcolors(maxcolors=area.width * area.height)  # [(count, (r, g, b))]
        drawn = 1 - sum(n for n, rgb in colours if rgb == (255, 255, 255)) / (area.width * area.height)
        colours = len(colours)
        assert drawn > 0.05 and colours >= 6, (cls, drawn, colours)
