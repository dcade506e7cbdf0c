"""A page as a real browser shows it: headless Chromium (Debian's ``chromium``) renders an HTML file.

Contract: :func:`find_chromium` gives the browser's path or ``None``. :func:`probe` loads the page and returns
what the browser laid out: the visible text (``innerText``), the page's height and the box (x, y, width, height in
CSS pixels) of every element matching a selector. :func:`screenshot` writes a PNG of the whole page at scale 1,
so those boxes are pixel boxes of the image. ``python -m lightning_ciuic.testing.browser PAGE.html OUT.png``
writes a screenshot (how docs/monitor.md's was made).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

WIDTH = 900
_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1"]
_PROBE = """<script>
const boxes = [...document.querySelectorAll(%s)].map(e => {
  const r = e.getBoundingClientRect();
  return {cls: e.getAttribute("class"), x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height};
});
const out = document.createElement("pre");
out.id = "ciuic-probe";
out.textContent = JSON.stringify({text: document.body.innerText, height: document.documentElement.scrollHeight, boxes});
document.body.appendChild(out);
</script>"""


def find_chromium() -> Optional[str]:
    return next((path for name in ("chromium", "chromium-browser", "google-chrome") if (path := shutil.which(name))), None)


def _run(args: list[str], timeout: float = 120.0) -> str:
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no headless Chromium: install Debian's package (apt-get install chromium)")
    done = subprocess.run([browser, *_FLAGS, *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def probe(page: Path, selector: str = "svg", width: int = WIDTH) -> dict[str, Any]:
    """``{"text": str, "height": int, "boxes": [{"cls", "x", "y", "width", "height"}]}`` of ``page`` as laid out."""
    source = Path(page).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "probe.html"
        copy.write_text(source.replace("</body>", _PROBE % json.dumps(selector) + "</body>"))
        dom = _run([f"--window-size={width},1000", "--dump-dom", copy.as_uri()])
    found = re.search(r'<pre id="ciuic-probe">(.*?)</pre>', dom, re.S)
    if found is None:
        raise RuntimeError("the page's probe did not run (no <body>?)")
    return json.loads(html.unescape(found.group(1)))


def screenshot(page: Path, out: Path, width: int = WIDTH, height: Optional[int] = None) -> Path:
    """A PNG of ``page`` (its whole height unless ``height`` is given) at ``out``."""
    height = height or int(probe(page, width=width)["height"])
    _run([f"--window-size={width},{height}", f"--screenshot={Path(out).resolve()}", Path(page).resolve().as_uri()])
    return Path(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m lightning_ciuic.testing.browser PAGE.html OUT.png")
    print(screenshot(Path(sys.argv[1]), Path(sys.argv[2])))
