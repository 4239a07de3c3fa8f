"""Issue 28's lifecycle in a real browser, by clicking only (no API call from the test, no
typing after signing in: the New job form starts filled in): open the New job form, see the API's
refusals beside the fields (a model too big for the GPUs, a layout left empty) and upload a
config.json as a model, create a job pending, start it from its page, watch steps arrive,
resize it 2 -> 4 GPUs through proposals, plan and confirmation, stop it, delete it.
Screenshots at 1400 px wide go to $DYNAPLANE_SCREENSHOTS, else the test's tmp dir."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.support.stack import wait_for
from tests.support.browser_pages import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(300)]

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}



def _step(page) -> int:
    return int(page.locator("#job-step").get_attribute("data-step") or 0)


def test_create_start_watch_resize_stop_and_delete_a_job_by_clicking(stack, browser, tmp_path) -> None:
    started = time.monotonic()
    shots = Path(os.environ.get("DYNAPLANE_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)  # a shared machine: the training ranks compete with the browser
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: msg.type == "error" and "the server responded with a status of" not in msg.text
            and errors.append(msg.text))  # (the 400s of the form's checks are logged by Chromium)
    sign_in(page, stack)
    job_id = None
    try:
        # The New job form: filled in, checked by the API as it changes.
        page.get_by_role("link", name="Jobs", exact=True).click()
        page.get_by_role("button", name="New job").click()
        form = page.locator("#new-job-form")
        page.wait_for_selector("#new-job-form[data-valid=true]")
        name = page.get_by_label("Name", exact=True).input_value()
        assert re.fullmatch(r"job-\d+", name), name
        preview = page.locator("#new-job-preview").inner_text()
        assert preview.startswith("Runs dp=2 on 2 GPUs on synthetic tokens, until stopped"), preview
        assert "parameters" in page.locator("#model-facts").inner_text()

        # A model too big for the virtual GPUs: the API's words, beside the GPU field.
        page.get_by_label("Model", exact=True).select_option("llama3-70b")
        page.wait_for_selector("#new-job-form[data-valid=false]")
        page.wait_for_selector("#error-gpus:not([hidden])")
        assert "exceeds the smallest GPU" in page.locator("#error-gpus").inner_text()
        assert page.locator("[data-field=gpus][data-invalid]").count() == 1
        page.screenshot(path=str(shots / "new-job-refused.png"), full_page=True)
        # The layout instead of a GPU count, left empty: refused beside the layout field.
        page.get_by_label("Layout", exact=True).check()
        page.wait_for_selector("#error-layout:not([hidden])")
        assert page.locator("#error-gpus").is_hidden()
        page.get_by_label("GPU count", exact=True).check()
        page.get_by_label("Model", exact=True).select_option("tiny-gpt")
        page.wait_for_selector("#new-job-form[data-valid=true]")
        assert page.locator("#error-gpus").is_hidden() and page.locator("#error-layout").is_hidden()

        # An uploaded config.json becomes a model of the list (chosen; the form checks it).
        config = tmp_path / "tiny-llama.json"
        config.write_text(json.dumps(TINY_LLAMA))
        page.locator("#upload summary").click()
        page.locator("#upload-file").set_input_files(str(config))  # the file chooser's answer
        upload_name = page.locator("#upload-name").input_value()
        assert upload_name == "tiny-llama"
        page.get_by_role("button", name="Upload").click()
        page.wait_for_selector("#upload-status:has-text('Stored as')")
        assert page.get_by_label("Model", exact=True).input_value() == upload_name
        page.wait_for_selector("#new-job-form[data-valid=true]")
        page.get_by_label("Model", exact=True).select_option("tiny-gpt")
        page.wait_for_selector("#new-job-form[data-valid=true]")

        # Create it pending (Start it now cleared), then its page.
        page.get_by_label("Start it now").uncheck()
        page.screenshot(path=str(shots / "new-job.png"), full_page=True)
        form.get_by_role("button", name="Create job").click()
        page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
        job_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
        page.wait_for_selector("#connection[data-state=live]")
        assert page.locator("#job-state").inner_text() == "pending"
        assert page.get_by_role("button", name="Start…").is_enabled()
        assert page.get_by_role("button", name="Delete…").is_enabled()
        assert page.get_by_role("button", name="Show proposals").is_disabled()
        assert "start it first" in page.locator("#resize-unavailable").inner_text()
        assert page.locator("[data-rank]").count() == 0

        # Start, confirmed; steps arrive live.
        page.get_by_role("button", name="Start…").click()
        dialog = page.get_by_role("dialog")
        assert f"Start {name}" in dialog.inner_text()
        dialog.get_by_role("button", name="Start now").click()
        page.wait_for_selector("#job-state[data-state=starting], #job-state[data-state=running]")
        assert page.get_by_role("button", name="Start…").is_disabled()
        assert page.get_by_role("button", name="Delete…").is_disabled()  # a live job is stopped first
        page.wait_for_selector("#job-state[data-state=running]", timeout=90_000)
        page.wait_for_function("document.querySelector('#chart-loss').dataset.points >= 3", timeout=90_000)
        first = _step(page)
        page.wait_for_function(f"Number(document.querySelector('#job-step').dataset.step) > {first}", timeout=30_000)
        assert page.locator("[data-rank]").count() == 2
        page.screenshot(path=str(shots / "job-started.png"), full_page=True)

        # Resize 2 -> 4 GPUs: count, proposals, plan preview, confirm, committed.
        page.get_by_role("button", name="One GPU more").click()
        page.get_by_role("button", name="One GPU more").click()
        page.get_by_role("button", name="Show proposals").click()
        page.get_by_role("button", name="Preview the switch to dp=4").click()
        page.wait_for_selector("#plan-heatmap .main-svg")
        page.get_by_role("button", name="Resize to dp=4…").click()
        page.get_by_role("dialog").get_by_role("button", name="Resize now").click()
        page.wait_for_selector("#progress-section[data-state=committed]", timeout=150_000)
        page.wait_for_function("document.querySelectorAll('[data-rank]').length === 4", timeout=30_000)
        page.wait_for_selector("#job-state[data-state=running]")
        assert page.locator("#job-layout").inner_text() == "dp=4 on 4 GPUs"
        # The plan of the committed switch is gone; the controls start from the new size, and the
        # proposals are asked again for it, from the new layout (issue 28: none left from dp=2).
        page.wait_for_selector("#proposals-section[data-layout='dp=4'][data-gpus='4']:not([hidden])")
        assert page.locator("#plan-section").is_hidden()
        assert page.locator("#resize-open").inner_text() == "Resize…"
        assert page.get_by_label("New GPU count", exact=True).input_value() == "4"
        assert page.get_by_role("button", name="Show proposals").is_enabled()
        page.screenshot(path=str(shots / "job-resized-by-clicks.png"), full_page=True)

        # Stop, confirmed: the ranks leave, the GPUs are free and drawn so, resizing is off.
        page.get_by_role("button", name="Stop…").click()
        dialog = page.get_by_role("dialog")
        assert f"Stop {name} at step" in dialog.inner_text()
        dialog.get_by_role("button", name="Stop job").click()
        page.wait_for_selector("#job-state[data-state=stopped]", timeout=60_000)
        page.wait_for_function("document.querySelectorAll('[data-rank]').length === 0", timeout=30_000)
        page.wait_for_function("document.querySelectorAll('[data-gpu][data-state=free]').length === 4", timeout=30_000)
        assert page.get_by_role("button", name="Show proposals").is_disabled()
        assert "is stopped" in page.locator("#resize-unavailable").inner_text()
        assert page.get_by_role("button", name="Start…").is_disabled()
        assert page.get_by_role("button", name="Stop…").is_disabled()
        page.screenshot(path=str(shots / "job-stopped.png"), full_page=True)

        # Delete, confirmed: back on the list, without the job.
        page.get_by_role("button", name="Delete…").click()
        page.get_by_role("dialog").get_by_role("button", name="Delete job").click()
        page.wait_for_url(re.compile(r".*/jobs/\?deleted="))
        assert f"Job {name} deleted." in page.locator("#jobs-notice").inner_text()
        assert page.locator(f"tr[data-job='{name}']").count() == 0
        page.screenshot(path=str(shots / "jobs-after-delete.png"), full_page=True)
        assert errors == [], errors
        print(f"create -> start -> steps -> resize -> stop -> delete by clicks in {time.monotonic() - started:.0f} s; "
              f"screenshots in {shots}")
    finally:
        if job_id is not None:
            try:
                state = stack.get(f"api/jobs/{job_id}", token=True)["state"]
            except Exception:  # noqa: BLE001 (deleted: nothing to clean up)
                state = None
            if state in ("starting", "running", "switching"):
                stack.post(f"api/jobs/{job_id}/stop", {})
                wait_for(lambda: stack.get(f"api/jobs/{job_id}", token=True)["state"] in ("stopped", "failed"),
                         timeout=60)
