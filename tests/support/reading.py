"""Issue 28's reading bar, shared by the browser tests that check pages against it: a
screenshot per page and width into test-artifacts/screenshots/ (gitignored;
$DYNAPLANE_SCREENSHOTS overrides), no number in scientific notation in the visible text or
the charts, no horizontal overflow at 390 px."""
from __future__ import annotations

import os
from pathlib import Path

from tests.support.stack import ROOT

WIDTHS = (1400, 390)
SCIENTIFIC = r"/(^|[^\w.])\d+(\.\d+)?e[+-]?\d+(?!\w)/i"
# The page's visible text and its charts' texts, and what in them reads as scientific
# notation; text inside <code> (identifiers such as plan fingerprints and digests, which are
# hex, not numbers) does not count.
VISIBLE_NUMBERS = """() => {
  const text = document.body.innerText;
  const svg = [...document.querySelectorAll('.main-svg text')].map((n) => n.textContent).join('\\n');
  const codes = [...document.querySelectorAll('code')].map((n) => n.innerText);
  const hits = [...(text + '\\n' + svg).matchAll(new RegExp(%s.source, 'gim'))].map((m) => m[0].replace(/^[^0-9]+/, ''))
    .filter((hit) => !codes.some((code) => code.includes(hit)));
  return { text, svg, hits };
}""" % SCIENTIFIC
OVERFLOW = "document.documentElement.scrollWidth - window.innerWidth"


def shots_dir() -> Path:
    path = Path(os.environ.get("DYNAPLANE_SCREENSHOTS") or ROOT / "test-artifacts" / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_page(page, name: str, width: int, shots: Path, *, charts: int = 0) -> dict:
    """Wait for the page's charts, screenshot it, and return what it shows."""
    if charts:
        page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {charts}",
                               timeout=30_000)
    page.wait_for_timeout(300)  # the charts' responsive resize after the first draw
    page.screenshot(path=str(shots / f"{name}-{width}.png"), full_page=True)
    seen = page.evaluate(VISIBLE_NUMBERS)
    assert seen["hits"] == [], (name, width, seen["hits"])
    assert "e+" not in seen["svg"], (name, width)
    if width <= 390:
        overflow = page.evaluate(OVERFLOW)
        assert overflow <= 0, f"{name} at {width} px is {overflow} px wider than the window"
    return seen
