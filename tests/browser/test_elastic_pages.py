"""Issue 31's dashboard in a real browser: an elastic job (range 1 to its size, priority 5)
runs and is shrunk 2 -> 1 GPU; a queued job of higher priority waits for GPUs. The elastic
page shows both with the waiting reason, every job's range and priority, and the cluster
timeline with the switch as a marker; the job page shows the range (the empty bound as the
current size), the priority and the pending change; clicking the policy switch and
confirming turns the policy off (the page and the API say so), and on again; the New job
form places the API's refusal of a range beside its field. Watched live (issues 31 and 28
loose ends): the jobs list's row of a job created meanwhile carries its range, priority and
queued mark, its cells follow a change made in the job page's range and priority form (whose
refusal sits beside its field) and the priority column sorts; the job page asks its resize
proposals again once the switch commits (the plan previewed for the old layout is gone) and
shows its node's CPU and memory. At 1400 and 390 px: screenshots
(test-artifacts/screenshots/), no horizontal overflow at 390 px, no scientific notation."""
from __future__ import annotations

import pytest

from tests.browser.test_dashboard import sign_in_directly
from tests.support.reading import OVERFLOW, WIDTHS, check_page, shots_dir
from tests.support.stack import wait_for, wait_for_transition_end

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(600)]


def _switch(page, action: str, expect: bool) -> None:
    page.get_by_role("button", name=f"Turn the elastic policy {action}…").click()
    dialog = page.get_by_role("dialog")
    assert f"Turn the elastic policy {action} for stretchy?" in dialog.inner_text()
    dialog.get_by_role("button", name=f"Turn {action}").click()
    page.wait_for_selector(f"#elastic-policy[data-elastic={str(expect).lower()}]", timeout=15_000)


def test_the_elastic_pages_show_ranges_decisions_and_switch_the_policy(stack, browser) -> None:
    shots = shots_dir()
    job = stack.post("api/jobs", {"name": "stretchy", "model": "tiny-gpt", "gpus": 2, "global_batch": 12,
                                  "seq_len": 16, "elastic": True, "min_gpus": 1, "priority": 5})
    urgent = None
    errors: list[str] = []
    try:
        # Watched live: the jobs list (a row arriving over the cluster stream carries its range,
        # priority and queued mark) and the job page (its proposals asked again once the switch
        # below commits; its node's CPU and memory; the range and priority form).
        watch = browser.new_context(viewport={"width": WIDTHS[0], "height": 900})
        listing, job_page = watch.new_page(), watch.new_page()
        for p in (listing, job_page):
            p.set_default_timeout(60_000)
            p.on("pageerror", lambda exc: errors.append(str(exc)))
        sign_in_directly(listing, stack)
        listing.wait_for_selector("#cluster-grid")
        listing.goto(stack.url + "jobs/")
        listing.wait_for_selector("#connection[data-state=live]")
        urgent = stack.post("api/jobs", {"name": "urgent", "model": "tiny-gpt", "gpus": 4, "global_batch": 12,
                                         "seq_len": 16, "queue": True, "priority": 9})
        row = listing.locator("tr[data-job=urgent]")
        row.wait_for()
        listing.wait_for_function("document.querySelector('tr[data-job=urgent] [data-field=priority]')"
                                  ".textContent === '9'")
        assert row.locator("[data-field=elastic]").inner_text() == "off 4 GPUs (follows the current size) queued"

        # A switch for the timeline's marker: 2 -> 1 GPU once it trains. Its range's upper bound
        # is unset, so it follows the size down: 1 GPU. Before it, the job page shows the
        # proposals for 1 GPU and previews tp=1 (its one-GPU name).
        wait_for(lambda: (stack.get(f"api/jobs/{job['id']}", token=True).get("step") or 0) >= 1, timeout=150)
        job_page.goto(stack.url + f"jobs/{job['id']}/")
        job_page.wait_for_selector("#job-state[data-state=running]")
        job_page.get_by_label("New GPU count", exact=True).fill("1")
        job_page.get_by_role("button", name="Show proposals").click()
        job_page.wait_for_selector("#proposals-section[data-layout='dp=2'][data-fetches='1']")
        job_page.get_by_role("button", name="Preview the switch to tp=1").click()
        job_page.wait_for_selector("#plan-heatmap .main-svg")
        assert job_page.locator("#resize-open").inner_text() == "Resize to tp=1…"
        # (its node's host line: the stack's agents report CPU and memory with their heartbeats)
        job_page.wait_for_selector("#job-gpus .node-row[data-job-node=true] [data-field=host-stats]", timeout=30_000)
        host = job_page.locator("#job-gpus .node-row[data-job-node=true] [data-field=host-stats]").first.inner_text()
        assert host.startswith("CPU ") and " % of " in host and " · mem " in host, host
        assert job_page.locator("#job-gpus .node-row[data-job-node=false] [data-field=host-stats]").count() == 0
        switch = stack.post(f"api/jobs/{job['id']}/resize", {"gpus": 1})
        committed, _ = wait_for_transition_end(stack, switch["id"])
        assert committed["state"] == "committed", committed
        # The plan made for dp=2 is gone and the proposals were asked again, from the new layout.
        job_page.wait_for_selector(f"#proposals-section[data-layout='{committed['destination_layout']}']"
                                   ":not([hidden])", timeout=30_000)
        assert job_page.locator("#plan-section").is_hidden()
        assert job_page.locator("#resize-open").inner_text() == "Resize…"
        assert int(job_page.locator("#proposals-section").get_attribute("data-fetches")) >= 2
        assert job_page.locator("#proposals-body tr").count() >= 1

        # The range and priority form: a refusal beside its field, then a change the list follows.
        job_page.get_by_label("Fewest GPUs").fill("3")
        job_page.get_by_role("button", name="Save range and priority").click()
        job_page.wait_for_selector("#elastic-error-min_gpus:not([hidden])")
        assert "min_gpus=3 is above the 1 GPUs the job runs on" in \
            job_page.locator("#elastic-error-min_gpus").inner_text()
        # (the empty upper bound is the job's size, 1: below the fewest, and its own field says so)
        assert job_page.locator("#elastic-error-max_gpus").inner_text() == "max_gpus=1 is below min_gpus=3"
        assert job_page.locator("#elastic-error-priority").is_hidden()
        assert job_page.locator("#elastic-error").is_hidden()
        job_page.get_by_label("Fewest GPUs").fill("1")
        job_page.get_by_label("Most GPUs").fill("2")
        job_page.get_by_label("Priority").fill("6")
        job_page.get_by_role("button", name="Save range and priority").click()
        job_page.wait_for_selector("#elastic-saved:has-text('saved')")
        assert job_page.locator("#elastic-error-min_gpus").is_hidden()
        job_page.wait_for_function("document.getElementById('elastic-range').textContent === '1–2 GPUs'")
        check_page(job_page, "job-elastic-form", WIDTHS[0], shots, charts=3)
        # The list's cells follow without a reload; the priority column sorts.
        listing.wait_for_function("document.querySelector('tr[data-job=stretchy] [data-field=elastic]')"
                                  ".textContent === 'on 1–2 GPUs'")
        assert listing.locator("tr[data-job=stretchy] [data-field=priority]").inner_text() == "6"
        listing.get_by_role("button", name="Priority", exact=True).click()
        listing.wait_for_selector("th[data-sort=priority][aria-sort=descending]")
        order = listing.eval_on_selector_all("#jobs-body tr:not([hidden])", "(rows) => rows.map((r) => r.dataset.job)")
        assert order.index("urgent") < order.index("stretchy"), order
        assert "sort=priority" in listing.url
        check_page(listing, "jobs-live-elastic", WIDTHS[0], shots)
        # Back as it was (the checks below read the range with its upper bound unset, priority 5).
        job_page.get_by_label("Most GPUs").fill("")
        job_page.get_by_label("Priority").fill("5")
        job_page.get_by_role("button", name="Save range and priority").click()
        job_page.wait_for_function("document.getElementById('elastic-range').textContent === "
                                   "'1 GPU (max follows the current size)'")
        listing.wait_for_function("document.querySelector('tr[data-job=stretchy] [data-field=priority]')"
                                  ".textContent === '5'")
        watch.close()
        for width in WIDTHS:
            context = browser.new_context(viewport={"width": width, "height": 900})
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            sign_in_directly(page, stack)
            page.wait_for_selector("#cluster-grid")
            page.get_by_role("navigation", name="Main").get_by_role("link", name="Elastic").click()
            page.wait_for_url("**/elastic/")
            check_page(page, "elastic", width, shots, charts=1)
            row = page.locator("#elastic-jobs-body tr[data-job=stretchy]")
            # (the range as the scheduler reads it: with the policy off, the job's size)
            assert row.locator("[data-field=range]").inner_text() == ("1 GPU" if width == WIDTHS[0]
                                                                       else "1 GPU (its size: policy off)")
            assert row.locator("[data-field=priority]").inner_text() == "5"
            assert row.locator("[data-field=policy]").inner_text() == ("on" if width == WIDTHS[0] else "off")
            waiting = page.locator("#waiting-list li[data-job=urgent]").inner_text()
            assert waiting.startswith("urgent: ") and len(waiting) > len("urgent: ") + 10, waiting
            # (the shared stack's earlier tests' jobs have their traces too)
            trace = page.evaluate("(({ name, y, text, marker }) => ({ name, y, text, sizes: marker.size }))"
                                  "(document.getElementById('elastic-timeline').data.find((t) => t.name === 'stretchy'))")
            assert trace["y"][0] == 2 and trace["y"][-1] == 1, trace["y"]
            (marked,) = [t for t, size in zip(trace["text"], trace["sizes"]) if size]
            assert marked.startswith(f"stretchy: 2 → 1 GPUs (#{switch['id']}, resize)"), marked
            assert page.locator("#elastic-timeline .scatterlayer .point").count() >= 1  # the diamond is drawn

            page.goto(stack.url + f"jobs/{job['id']}/")
            page.wait_for_function("!document.getElementById('elastic-pending').textContent.startsWith('asking')")
            assert page.locator("#elastic-range").inner_text() == "1 GPU (max follows the current size)"
            assert page.locator("#elastic-priority").inner_text() == "5"
            check_page(page, "job-elastic", width, shots, charts=3)
            if width == WIDTHS[0]:
                assert page.locator("#elastic-policy").inner_text() == "on"
                _switch(page, "off", False)
                assert page.locator("#elastic-policy").inner_text() == "off"
                page.wait_for_function("document.getElementById('elastic-pending').textContent"
                                       ".includes('policy off')")
                assert stack.get(f"api/jobs/{job['id']}", token=True)["elastic"] is False
                page.screenshot(path=str(shots / f"job-elastic-off-{width}.png"), full_page=True)
            else:
                assert page.locator("#elastic-policy").inner_text() == "off"
                _switch(page, "on", True)
                assert stack.get(f"api/jobs/{job['id']}", token=True)["elastic"] is True
                assert page.evaluate(OVERFLOW) <= 0

            page.goto(stack.url + "jobs/")
            listed = page.locator("tr[data-job=stretchy] [data-field=elastic]").inner_text()
            assert listed == ("off 1 GPU (max follows the current size)" if width == WIDTHS[0]
                              else "on 1 GPU (max follows the current size)"), listed
            page.get_by_role("button", name="New job").click()
            page.get_by_label("let the elastic scheduler resize it within its range").check()
            page.get_by_label("Fewest GPUs").fill("3")
            page.wait_for_selector("#error-min_gpus:not([hidden])")
            assert "min_gpus=3 is above the 2 GPUs the job runs on" in page.locator("#error-min_gpus").inner_text()
            check_page(page, "jobs-new-elastic", width, shots)
            page.get_by_label("Fewest GPUs").fill("1")
            page.get_by_label("Priority").fill("4")
            page.wait_for_function("document.getElementById('new-job-preview').textContent.includes('elastic within')")
            assert "elastic within 1–2 GPUs (max follows the current size), priority 4." in \
                page.locator("#new-job-preview").inner_text()
            context.close()
        assert errors == [], errors
    finally:
        for j in (job, urgent) if urgent else (job,):
            if stack.get(f"api/jobs/{j['id']}", token=True)["state"] not in ("stopped", "failed"):
                stack.post(f"api/jobs/{j['id']}/stop", {})
        for j in (job, urgent) if urgent else (job,):
            wait_for(lambda j=j: stack.get(f"api/jobs/{j['id']}", token=True)["state"] in ("stopped", "failed"),
                     timeout=60)
