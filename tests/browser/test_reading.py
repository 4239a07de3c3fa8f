"""Issue 28's reading bar in a real browser: every page, with real content (a job that has
trained, switched 2 -> 4 GPUs and trains on; a finished emulation on compare), at 1400 px
and at 390 px (a phone): a screenshot of each into test-artifacts/screenshots/ (gitignored;
$DYNAPLANE_SCREENSHOTS overrides), no horizontal overflow at 390 px, no number in scientific
notation in any page's visible text, and the charts' reading aids (switch markers, "no data
yet", smoothing, the time axis)."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.browser.test_dashboard import sign_in_directly
from tests.support.reading import OVERFLOW, WIDTHS, check_page as _check_page, shots_dir as _shots
from tests.support.stack import wait_for, wait_for_transition_end

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(600)]


def test_every_page_reads_at_1400_and_390_px(stack, browser) -> None:
    started = time.monotonic()
    shots = _shots()
    # Content first: an emulation on the agents while a job trains, switches, trains on.
    emulation = stack.post("api/emulations", {"configs": [
        {"model": "tiny-gpt", "layout": "tp=2", "gpus": 2, "gpu_type": "h100", "global_batch": 8, "micro_batch": 1,
         "seq_len": 64}]})["runs"][0]
    job = stack.post("api/jobs", {"name": "reading", "model": "tiny-gpt", "gpus": 2, "global_batch": 12,
                                  "seq_len": 16})
    try:
        wait_for(lambda: (stack.get(f"api/jobs/{job['id']}", token=True).get("step") or 0) >= 3, timeout=150)
        switch = stack.post(f"api/jobs/{job['id']}/resize", {"gpus": 4})
        committed, _ = wait_for_transition_end(stack, switch["id"])
        assert committed["state"] == "committed", committed
        step = stack.get(f"api/jobs/{job['id']}", token=True)["step"]
        wait_for(lambda: stack.get(f"api/jobs/{job['id']}", token=True)["step"] >= step + 3, timeout=90)
        wait_for(lambda: stack.get(f"api/emulations/{emulation['id']}")["state"] in ("done", "failed"), timeout=240)
        assert stack.get(f"api/emulations/{emulation['id']}")["state"] == "done"
        compare = (f"compare/?model=tiny-gpt&gpu=h100&gpus=2&batch=8&micro=1&seq=64&layout=tp%3D2"
                   f"&runs={emulation['id']}")
        pages = [("cluster", "", 0), ("jobs", "jobs/", 0), ("job", f"jobs/{job['id']}/", 3),
                 ("transition", f"transitions/{switch['id']}/", 3), ("compare", compare, 3),
                 ("not-found", "jobs/999999/", 0)]
        errors: list[str] = []
        for width in WIDTHS:
            context = browser.new_context(viewport={"width": width, "height": 900})
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(stack.url + "accounts/login/")
            _check_page(page, "login", width, shots)
            sign_in_directly(page, stack)
            page.wait_for_selector("#cluster-grid")
            for name, path, charts in pages:
                page.goto(stack.url + path)
                seen = _check_page(page, name, width, shots, charts=charts)
                if name == "not-found":  # the site's navigation on the 404 page
                    assert page.get_by_role("navigation", name="Main").get_by_role("link", name="Jobs").is_visible()
                    assert "Page not found (404)" in seen["text"]
                if name == "jobs":
                    assert re.search(r"\b(just now|\d+ (s|min) ago)\b", seen["text"]), seen["text"]
                    assert page.locator("tr[data-job=reading] time").get_attribute("title")  # the local time on hover
                if name == "transition":
                    assert not re.search(r"\d{4}-\d\d-\d\dT", seen["text"])  # no raw ISO stamps
                    assert " ms" in seen["text"] or " s" in seen["text"]
                    assert "MB" not in seen["text"] and "KB" not in seen["text"]  # binary units only
                if name == "job":
                    _job_charts(page, width, shots)
            context.close()
        assert errors == [], errors
        print(f"screenshots of {len(pages) + 1} pages at {WIDTHS} px in {shots}; "
              f"{time.monotonic() - started:.0f} s")
    finally:
        if stack.get(f"api/jobs/{job['id']}", token=True)["state"] in ("starting", "running", "switching"):
            stack.post(f"api/jobs/{job['id']}/stop", {})
        wait_for(lambda: stack.get(f"api/jobs/{job['id']}", token=True)["state"] in ("stopped", "failed"), timeout=60)


def _job_charts(page, width: int, shots: Path) -> None:
    """The switch's marker on every training chart, labels that do not overlap, the band
    reaching the newest step, the smoothing control and the time axis."""
    page.wait_for_function("document.querySelector('#chart-step_seconds').dataset.bands === '2'", timeout=30_000)
    for name in ("loss", "step_seconds", "tokens_per_second"):
        shapes = page.evaluate(f"document.getElementById('chart-{name}').layout.shapes")
        assert [s["name"] for s in shapes if s["type"] == "line"] == [f"switch {_switch_id(page)}"], name
        boxes = page.evaluate(f"[...document.querySelectorAll('#chart-{name} .annotation')]"
                              ".map((n) => n.getBoundingClientRect().toJSON())")
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                apart = (a["right"] <= b["left"] + 1 or b["right"] <= a["left"] + 1
                         or a["bottom"] <= b["top"] + 1 or b["bottom"] <= a["top"] + 1)
                assert apart, (name, a, b)
    # The band is drawn with the data: in every chart as drawn, it reaches the newest point.
    drawn = page.evaluate("""['loss', 'step_seconds', 'tokens_per_second'].map((name) => {
      const chart = document.getElementById('chart-' + name);
      return [Math.max(...chart.layout.shapes.filter((s) => s.type === 'rect').map((s) => s.x1)),
              Math.max(...chart.data[0].x)]; })""")
    assert all(band_end >= newest for band_end, newest in drawn), drawn
    page.get_by_label("Smoothing").focus()
    page.keyboard.press("End")  # the keyboard moves the slider: the most smoothing, 0.99
    page.wait_for_function("document.getElementById('chart-loss').data.length === 2")
    assert page.locator("#smoothing-value").inner_text() == "0.99"
    page.get_by_label("time").check()
    page.wait_for_function("document.getElementById('chart-loss').dataset.axis === 'time'")
    title = page.evaluate("document.getElementById('chart-loss').layout.xaxis.title.text")
    assert title == "time since the first step (s)"
    xs = page.evaluate("document.getElementById('chart-step_seconds').data[0].x")
    assert xs == sorted(xs) and xs[-1] > 0
    page.screenshot(path=str(shots / f"job-smoothed-time-axis-{width}.png"), full_page=True)
    if width <= 390:
        assert page.evaluate(OVERFLOW) <= 0


def _switch_id(page) -> int:
    return page.evaluate("window.dynaplane.live.transitions.find((t) => t.state === 'committed').id")
