"""A real browser on a job of the real stack (issue 42): a job on a dataset with a validation split
evaluates its validation loss every 2 steps on the agents; the job page draws it live on the loss
chart as a second trace ("validation"); once the job has a checkpoint, "Export to Hugging Face"
queues the export, the control worker (the `exports` queue) writes it, and the page follows it to
`done` with the directory under the exports root; the same click again shows the API's refusal."""
from __future__ import annotations

import json

import pytest

from tests.support.browser_pages import sign_in
from tests.support.datasets import TEXTS, text_dataset
from tests.support.stack import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(300)]


def test_validation_curve_and_export_by_clicking(stack, browser) -> None:  # noqa: F811
    text_dataset(stack.var_dir / "data" / "evalcode", texts=TEXTS * 3, validation_fraction=0.25)
    stack.post("api/datasets", {"path": "evalcode"})
    job = stack.post("api/jobs", {"name": "evaluated", "model": "tiny-gpt", "gpus": 2, "global_batch": 4,
                                  "seq_len": 16, "dataset": "evalcode", "eval_every": 2, "eval_batches": 1,
                                  "checkpoint_interval": 3, "max_steps": 6})
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
    sign_in(page, stack)
    page.goto(stack.url + f"jobs/{job['id']}/")
    page.wait_for_selector("#connection[data-state=live]", timeout=15_000)
    assert "validation loss every 2 steps (1 batch)" in page.locator("#job-eval").inner_text()
    # Steps 2, 4 and 6 evaluate (max_steps 6): three validation points, live, on the loss chart.
    page.wait_for_function("document.getElementById('chart-loss').dataset.validationPoints === '3'",
                           timeout=180_000)
    names = page.evaluate("document.getElementById('chart-loss').data.map((t) => t.name)")
    assert names == ["loss", "validation"], names
    live = stack.get(f"api/jobs/{job['id']}/live")["metrics"]
    assert live["validation_loss"]["x"] == [2.0, 4.0, 6.0]
    assert page.evaluate("document.getElementById('chart-loss').data[1].y") == live["validation_loss"]["y"]
    wait_for(lambda: stack.get(f"api/jobs/{job['id']}").get("checkpoint_step") == 6, timeout=120)

    page.get_by_role("button", name="Export to Hugging Face").click()
    page.wait_for_selector("#export-list li[data-state=done]", timeout=180_000)
    row = page.locator("#export-list li").first.inner_text()
    assert "step 6 → evaluated-step-6" in row and "done: 1 file," in row, row
    out = stack.var_dir / "exports" / "evaluated-step-6"
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert errors == [], errors
    # The same directory again: the API's refusal, in its words, under the card (and the browser's
    # console line about the 400).
    page.get_by_role("button", name="Export to Hugging Face").click()
    page.wait_for_selector("#export-error:not([hidden])")
    assert "evaluated-step-6 exists already under the exports root" in page.locator("#export-error").inner_text()
    page.screenshot(path=str(stack.var_dir / "job-validation-export.png"), full_page=True)
    assert all("status of 400" in e for e in errors), errors
