"""A real browser on the compare page: pick settings and two layouts, watch them run on the
agents' emulators, read the figures side by side, export CSV, reopen from the URL."""
from __future__ import annotations

import csv
import io
import time
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.browser.test_dashboard import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(240)]

LAYOUTS = ["tp=2,dp=2,zero=1", "pp=2,dp=2"]


# Every Plotly chart on the page fills its card's width (within 10 %) and stays inside the
# card (Plotly's responsive resize used to feed the div's leftover height back, so after a
# resize charts spilled over the cards below them) and the window (no horizontal scrolling).
CHARTS_FIT = """() => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  if (!plots.length || document.documentElement.scrollWidth > window.innerWidth) return false;
  return plots.every((plot) => {
    const svg = plot.querySelector('.main-svg');
    const card = plot.parentElement.getBoundingClientRect();
    if (!svg) return false;
    const box = svg.getBoundingClientRect();
    return box.left >= card.left - 1 && box.right <= card.right + 1 && box.top >= card.top - 1
      && box.bottom <= card.bottom + 1 && box.width >= 0.9 * card.width;
  });
}"""


def _watch_errors(page) -> list[str]:
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
    return errors


def test_compare_two_emulated_configs_export_csv_and_reopen(stack, browser) -> None:  # noqa: F811
    emulations_before = stack.get("api/emulations")["count"]  # (the stack is shared with other tests)
    context = browser.new_context(viewport={"width": 1366, "height": 900}, accept_downloads=True)
    page = context.new_page()
    errors = _watch_errors(page)
    sign_in(page, stack)
    page.get_by_role("link", name="Compare").click()
    page.wait_for_selector("#connection[data-state=live]", timeout=10_000)
    assert page.get_by_role("heading", name="Compare emulated configurations").is_visible()

    page.get_by_label("Model").select_option("tiny-gpt")
    page.get_by_label("GPU type").select_option("h100")
    page.get_by_label("GPUs", exact=True).fill("4")
    page.get_by_label("Global batch").fill("8")
    page.get_by_label("Micro-batch").fill("1")
    page.get_by_label("Sequence length").fill("64")
    # The labelled controls are reachable with the keyboard, in reading order.
    page.get_by_label("Model").focus()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "f-gpu"

    # A layout that does not fit the GPU count: nothing is queued, the reason names it.
    layout_box = page.get_by_label("Layout", exact=True)
    layout_box.fill("dp=2")
    layout_box.press("Enter")
    page.get_by_role("button", name="Run comparison").click()
    alert = page.locator("#form-errors")
    alert.get_by_text("Nothing was queued").wait_for(timeout=10_000)
    assert "Layout #1 (dp=2): gpus: layout dp=2 needs 2 GPUs, not 4" in alert.inner_text(), alert.inner_text()
    page.screenshot(path=str(stack.var_dir / "compare-refused.png"), full_page=True)
    page.get_by_role("button", name="Remove layout dp=2").press("Enter")  # keyboard, not a click
    assert page.locator("#layout-list li").count() == 0

    layout_box.fill(LAYOUTS[0])
    layout_box.press("Enter")
    layout_box.fill(LAYOUTS[1])
    page.get_by_role("button", name="Add layout").click()
    assert page.locator("#layout-list li").all_inner_texts() == [f"{x} Remove" for x in LAYOUTS]

    started = time.monotonic()
    page.get_by_role("button", name="Run comparison").click()
    page.wait_for_selector("#run-list progress", timeout=10_000)  # progress while queued / running
    assert page.get_by_role("button", name="Running…").is_disabled()
    page.screenshot(path=str(stack.var_dir / "compare-running.png"), full_page=True)
    page.wait_for_selector("body[data-done=true]", timeout=180_000)
    seconds = time.monotonic() - started
    assert page.locator("#run-list [data-state=done]").count() == 2, page.locator("#run-list").inner_text()
    assert "runs=" in page.url and "layout=tp%3D2%2Cdp%3D2%2Czero%3D1" in page.url

    # Side by side: every chart drawn, one bar group per configuration.
    for chart in ("breakdown-chart", "memory-chart", "throughput-chart"):
        page.wait_for_selector(f"#{chart} .main-svg", timeout=10_000)
    figures = page.evaluate("window.dynaplaneCompare.figures")
    assert figures["breakdown"]["data"][0]["x"] == [f"#1 {LAYOUTS[0]}", f"#2 {LAYOUTS[1]}"]
    assert figures["memory"]["data"][0]["x"][1] == ["stage 0", "stage 0", "stage 1"]  # pp=2: two stages
    assert figures["breakdown"]["data"][3]["y"][1] > 0  # PP communication only in the pipelined layout
    differs = page.locator("#settings-body tr.differs")
    assert differs.count() == 1 and differs.first.get_attribute("data-setting") == "layout"
    assert page.locator("#results-body tr").count() == 2
    page.screenshot(path=str(stack.var_dir / "compare-results.png"), full_page=True)

    with page.expect_download() as download_info:
        page.get_by_role("link", name="Export CSV").click()
    download = download_info.value
    assert download.suggested_filename.startswith("dynaplane-compare-")
    rows = list(csv.DictReader(io.StringIO(open(download.path()).read())))
    assert [r["layout"] for r in rows] == LAYOUTS
    assert all(r["state"] == "done" and float(r["step_seconds"]) > 0 and float(r["tokens_per_second"]) > 0
               for r in rows)
    assert {(r["model"], r["gpus"], r["gpu_type"], r["global_batch"], r["seq_len"]) for r in rows} == {
        ("tiny-gpt", "4", "h100", "8", "64")}
    assert float(rows[1]["pp_comm"]) > 0 == float(rows[0]["pp_comm"])

    # The URL reopens the same comparison: same runs and figures, nothing run again.
    url = page.url
    wide = context.new_page()  # same session
    wide.set_viewport_size({"width": 1920, "height": 1080})
    errors += _watch_errors(wide)
    wide.goto(url)
    wide.wait_for_selector("#breakdown-chart .main-svg", timeout=10_000)
    assert wide.locator("body").get_attribute("data-done") == "true"
    assert wide.locator("#layout-list li code").all_inner_texts() == LAYOUTS
    assert wide.get_by_label("Sequence length").input_value() == "64"
    reopened = wide.evaluate("window.dynaplaneCompare.snapshot")
    ids = [int(i) for i in parse_qs(urlsplit(url).query)["runs"][0].split(",")]
    assert [r["id"] for r in reopened["runs"]] == ids and len(ids) == 2
    assert wide.evaluate("window.dynaplaneCompare.figures") == figures
    wide.screenshot(path=str(stack.var_dir / "compare-reopened-1920.png"), full_page=True)
    assert stack.get("api/emulations")["count"] == emulations_before + 2
    # The one console error is the refused request's 400, which the page explained above.
    assert [e for e in errors if "status of 400" not in e] == [] and len(errors) == 1, errors
    context.close()
    print(f"two emulations ran and showed side by side {seconds:.1f} s after Run; screenshots in {stack.var_dir}")


def test_take_the_top_k_from_search(stack, browser) -> None:  # noqa: F811
    """An agent ranks the candidates for tiny-gpt on 2 GPUs (a search run on the emulate
    queue, followed over the websocket); they are emulated on the agents and the fastest
    one that fits stays in the comparison (and in the URL that reopens it). A setting no
    layout fits ends with the agent's reason on the page."""
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page = context.new_page()
    errors = _watch_errors(page)
    sign_in(page, stack)
    page.goto(f"{stack.url}compare/?model=tiny-gpt&gpu=h100&gpus=2&batch=8&micro=1&seq=64")
    page.wait_for_selector("#connection[data-state=live]", timeout=10_000)
    page.get_by_label("Top", exact=True).fill("1")
    started = time.monotonic()
    page.get_by_role("button", name="Take the top K from search").press("Enter")  # keyboard operable
    page.wait_for_function("document.querySelector('#search-status').textContent.includes('Search: emulating')",
                           timeout=120_000)
    ranked = time.monotonic() - started
    page.wait_for_function("document.querySelector('#search-status').textContent.includes('kept the')",
                           timeout=180_000)
    seconds = time.monotonic() - started
    status = page.locator("#search-status").inner_text()
    assert "3 of 4 candidates emulated; kept the 1 fastest that fit" in status, status
    page.wait_for_selector("body[data-done=true]", timeout=30_000)
    snapshot = page.evaluate("window.dynaplaneCompare.snapshot")
    assert len(snapshot["runs"]) == 1 and snapshot["runs"][0]["state"] == "done"
    kept = snapshot["runs"][0]
    assert page.locator("#layout-list li code").all_inner_texts() == [kept["layout"]]
    assert f"runs={kept['id']}" in page.url and parse_qs(urlsplit(page.url).query)["layout"] == [kept["layout"]]
    # The agent's ranking is stored as the search run's result; its candidates were emulated,
    # and the page kept the fastest of them that fit (what `dynaplane search` keeps).
    listed = [r for r in stack.get("api/emulations")["results"] if r["gpus"] == 2]
    (searched,) = [r for r in listed if r["kind"] == "search"]
    assert (searched["state"], searched["top"], searched["result"]["candidates"]) == ("done", 1, 4)
    tried = [r for r in listed if r["kind"] == "emulate"]
    assert sorted(r["layout"] for r in tried) == sorted(searched["result"]["layouts"]) and len(tried) == 3
    fitting = [r for r in tried if r["state"] == "done" and r["result"]["memory"]["fits"]]
    assert max(fitting, key=lambda r: r["result"]["tokens_per_second"])["id"] == kept["id"]
    page.wait_for_selector("#breakdown-chart .main-svg", timeout=10_000)
    page.screenshot(path=str(stack.var_dir / "compare-search-top.png"), full_page=True)
    # A live window resize: the charts follow their cards, narrower and wider, never spilling.
    for width in (760, 1700):
        page.set_viewport_size({"width": width, "height": 900})
        page.wait_for_function(CHARTS_FIT, timeout=10_000)
        page.screenshot(path=str(stack.var_dir / f"compare-search-top-{width}.png"), full_page=True)

    # Nothing fits: the agent's reason, and nothing emulated.
    emulated = len([r for r in stack.get("api/emulations")["results"] if r["kind"] == "emulate"])
    page.get_by_label("Model").select_option("llama3-405b")
    page.get_by_label("GPUs", exact=True).fill("1")
    page.get_by_role("button", name="Take the top K from search").click()
    alert = page.locator("#form-errors")
    alert.get_by_text("Search failed").wait_for(timeout=120_000)
    assert ("no layout of llama3-405b runs on 1 GPU with global batch 8 and micro-batch 1" in alert.inner_text()
            and "Nothing was emulated" in alert.inner_text()), alert.inner_text()
    assert len([r for r in stack.get("api/emulations")["results"] if r["kind"] == "emulate"]) == emulated
    page.screenshot(path=str(stack.var_dir / "compare-search-failed.png"), full_page=True)
    assert errors == [], errors
    context.close()
    print(f"search: ranked on an agent in {ranked:.1f} s, 3 candidates emulated, the fastest kept "
          f"{seconds:.1f} s after the click")
