"""Issue 28's remaining dashboard items in a real browser, by clicking: the jobs list sorted
by a header, filtered by state and searched, kept in the address (a reload shows the same
view) and live under the filter; a job's rank 0 log panel filling as it trains and showing
its last lines after a stop; a stopped job's resize controls disabled with the reason shown
before anything is clicked, and no ranks drawn; node CPU and memory on the cluster page;
no overflow at 390 px. Screenshots go to test-artifacts/screenshots/ ($DYNAPLANE_SCREENSHOTS)."""
from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import pytest

from tests.browser.test_dashboard import sign_in_directly
from tests.browser.test_reading import OVERFLOW
from tests.support.stack import ROOT, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(420)]

NAMES = ("view-alpha", "view-beta-10", "view-beta-2", "view-gamma")


def shots_dir() -> Path:
    path = Path(os.environ.get("DYNAPLANE_SCREENSHOTS") or ROOT / "test-artifacts" / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _names(page) -> list[str]:
    return page.eval_on_selector_all("#jobs-body tr:not([hidden])", "rows => rows.map((r) => r.dataset.job)")


def _delete(stack, job_id: int) -> None:
    request = urllib.request.Request(f"{stack.url}api/jobs/{job_id}", method="DELETE",
                                     headers={"Authorization": f"Token {stack.state['token']}"})
    urllib.request.urlopen(request, timeout=30).close()


def test_jobs_list_view_log_panel_and_a_stopped_jobs_controls(stack, browser) -> None:
    shots = shots_dir()
    jobs = {name: stack.post("api/jobs", {"name": name, "model": "tiny-gpt", "gpus": 1, "start": False,
                                          "global_batch": 4, "seq_len": 16}) for name in NAMES}
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        sign_in_directly(page, stack)
        page.wait_for_selector("#connection[data-state=live]")
        # Node CPU and memory on the cluster page, through the formatter.
        page.wait_for_selector("[data-field=host-stats]", timeout=30_000)
        host = page.locator("[data-field=host-stats]").first.inner_text()
        assert re.fullmatch(r"CPU \d+(\.\d+)? % of \d+ · mem \d+(\.\d+)? [KMGT]iB / \d+(\.\d+)? [KMGT]iB", host), host

        # The list: search, then sort by clicking the Name header, both ways.
        page.get_by_role("link", name="Jobs", exact=True).click()
        page.wait_for_selector("#connection[data-state=live]")
        page.get_by_label("Search").fill("view-")
        page.wait_for_function("location.search.includes('q=view-')")
        assert sorted(_names(page)) == sorted(NAMES)
        page.get_by_role("button", name="Name", exact=True).click()
        assert _names(page) == ["view-alpha", "view-beta-2", "view-beta-10", "view-gamma"]  # natural order
        assert page.locator("th[data-sort=name]").get_attribute("aria-sort") == "ascending"
        page.get_by_role("button", name="Name", exact=True).click()
        assert _names(page) == ["view-gamma", "view-beta-10", "view-beta-2", "view-alpha"]
        page.get_by_label("Search").fill("beta")
        assert _names(page) == ["view-beta-10", "view-beta-2"]
        assert page.locator("#jobs-count").inner_text() == f"2 of {page.locator('#jobs-body tr').count()} jobs"
        # The address holds the view: a reload (or a shared link) shows the same list.
        assert "sort=name" in page.url and "dir=desc" in page.url and "q=beta" in page.url
        page.reload()
        page.wait_for_selector("#connection[data-state=live]")
        assert _names(page) == ["view-beta-10", "view-beta-2"]
        assert page.get_by_label("Search").input_value() == "beta"
        assert page.locator("th[data-sort=name]").get_attribute("aria-sort") == "descending"

        # Filter by state, live: starting a pending job (here through the API) adds it under
        # "active" without a reload, and it leaves "pending".
        page.get_by_label("Search").fill("view-")
        page.get_by_label("State", exact=True).select_option("active")
        page.wait_for_selector("#jobs-none-match:not([hidden])")
        page.screenshot(path=str(shots / "jobs-filtered-none-1400.png"), full_page=True)
        alpha = jobs["view-alpha"]
        stack.post(f"api/jobs/{alpha['id']}/start", {})
        page.wait_for_function("document.querySelectorAll('#jobs-body tr:not([hidden])').length === 1",
                               timeout=30_000)
        assert _names(page) == ["view-alpha"] and page.locator("#jobs-none-match").is_hidden()
        page.get_by_label("State", exact=True).select_option("pending")
        assert sorted(_names(page)) == ["view-beta-10", "view-beta-2", "view-gamma"]
        assert "state=pending" in page.url
        page.set_viewport_size({"width": 390, "height": 900})
        page.wait_for_timeout(200)
        assert page.evaluate(OVERFLOW) <= 0
        page.screenshot(path=str(shots / "jobs-filtered-390.png"), full_page=True)
        page.set_viewport_size({"width": 1400, "height": 1000})

        # A job's page: rank 0's log fills as it trains.
        page.get_by_label("State", exact=True).select_option("")
        page.get_by_role("link", name="view-alpha").click()
        page.wait_for_selector("#job-state[data-state=running]", timeout=120_000)
        page.wait_for_function("Number(document.querySelector('#job-log').dataset.lines) >= 1", timeout=60_000)
        assert re.search(r"rank 0: training \S+ on 1 ranks, ready in", page.locator("#job-log").inner_text())
        assert "rank 0 on node-" in page.locator("#job-log-status").inner_text()
        page.set_viewport_size({"width": 390, "height": 900})
        page.wait_for_timeout(300)
        assert page.evaluate(OVERFLOW) <= 0
        page.screenshot(path=str(shots / "job-log-390.png"), full_page=True)
        page.set_viewport_size({"width": 1400, "height": 1000})

        # Stop it by clicking: its last lines arrive, the resize is off with the reason, no ranks drawn.
        page.get_by_role("button", name="Stop…").click()
        page.get_by_role("dialog").get_by_role("button", name="Stop job").click()
        page.wait_for_selector("#job-state[data-state=stopped]", timeout=60_000)
        page.wait_for_selector("#job-log[data-finished=true]", timeout=30_000)
        assert re.search(r"rank 0: \d+ steps in", page.locator("#job-log").inner_text())
        assert "rank 0 has exited" in page.locator("#job-log-status").inner_text()
        page.get_by_label("only errors and warnings").check()
        shown = page.locator("#job-log .log-line").count()
        assert shown == page.locator("#job-log .log-line[data-level=error], #job-log .log-line[data-level=warning]").count()
        page.wait_for_function("document.querySelectorAll('[data-rank]').length === 0", timeout=30_000)
        assert page.get_by_role("button", name="Show proposals").is_disabled()
        assert page.get_by_role("button", name="One GPU more").is_disabled()
        assert "is stopped" in page.locator("#resize-unavailable").inner_text()
        page.screenshot(path=str(shots / "job-stopped-log-1400.png"), full_page=True)

        # A stopped job's page opened afresh: disabled before anything is clicked.
        page.reload()
        page.wait_for_selector("#connection[data-state=live]")
        assert page.locator("#resize-unavailable").is_visible()
        assert "is stopped" in page.locator("#resize-unavailable").inner_text()
        assert page.get_by_role("button", name="Show proposals").is_disabled()
        assert page.locator("[data-rank]").count() == 0
        assert page.locator("#job-log[data-finished=true]").count() == 1  # the stored tail, embedded
        assert errors == [], errors
    finally:
        for job in jobs.values():
            state = stack.get(f"api/jobs/{job['id']}", token=True)["state"]
            if state not in ("pending", "stopped", "failed"):
                stack.post(f"api/jobs/{job['id']}/stop", {})
                wait_for(lambda j=job: stack.get(f"api/jobs/{j['id']}", token=True)["state"] in ("stopped", "failed"),
                         timeout=60)
            _delete(stack, job["id"])
