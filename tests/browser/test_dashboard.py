"""A real browser on the dashboard: sign in, see the live grid, watch an agent die."""
from __future__ import annotations

import os
import signal
import time

import pytest


pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(180)]


def sign_in(page, stack) -> None:
    page.goto(stack.url)
    assert "/accounts/login/" in page.url
    page.get_by_label("Username").fill(stack.state["username"])
    page.get_by_label("Password").fill("wrong-password")
    page.get_by_role("button", name="Sign in").click()
    assert page.get_by_role("alert").inner_text().startswith("That username and password do not match")
    page.get_by_label("Password").fill(stack.state["password"])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_selector("#cluster-grid", timeout=15_000)
    assert page.url == stack.url


def sign_in_directly(page, stack) -> None:
    """The login page, the right password at once."""
    page.goto(stack.url + "accounts/login/")
    page.get_by_label("Username").fill(stack.state["username"])
    page.get_by_label("Password").fill(stack.state["password"])
    page.get_by_role("button", name="Sign in").click()


def test_dashboard_is_live_and_shows_lost_gpus_without_reload(stack, browser) -> None:  # noqa: F811
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
    sign_in(page, stack)

    page.wait_for_selector("#connection[data-state=live]", timeout=10_000)
    assert page.locator("[data-node]").count() == 2
    assert page.locator("[data-gpu][data-state=free]").count() == 4
    assert page.locator("#gpu-map").get_attribute("data-cells") == "4"  # the GPU map (a canvas) drew every GPU
    page.evaluate("window.__sameDocument = true")

    # A job created through the API appears in the jobs list live.
    stack.post("api/jobs", {"name": "browser-job", "model": "tiny-gpt", "layout": "dp=2", "start": False})
    page.wait_for_selector("tr[data-job=browser-job]", timeout=10_000)

    os.kill(stack.child_pids()["agent-node-2"], signal.SIGKILL)
    killed = time.monotonic()
    page.wait_for_function(
        "document.querySelectorAll('[data-gpu^=\"node-2/\"][data-state=lost]').length === 2", timeout=15_000
    )
    seconds = time.monotonic() - killed
    assert page.locator('[data-node="node-2"]').get_attribute("data-state") == "lost"
    assert page.locator('[data-gpu^="node-1/"][data-state=free]').count() == 2
    assert page.evaluate("window.__sameDocument") is True, "the page reloaded"
    assert "2 free" in page.locator("#summary").inner_text() and "2 lost" in page.locator("#summary").inner_text()
    assert errors == []
    print(f"dashboard showed node-2's GPUs lost {seconds:.1f} s after its agent was killed")
    page.screenshot(path=str(stack.var_dir / "dashboard.png"), full_page=True)


def test_the_cluster_page_loads_nothing_from_elsewhere(stack, browser) -> None:  # noqa: F811
    page = browser.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    sign_in_directly(page, stack)
    page.wait_for_selector("#gpu-map[data-cells='4']", timeout=10_000)
    assert requests and all(url.startswith(stack.url) or url.startswith("ws://") for url in requests), requests


def test_the_api_docs_are_interactive_and_offline(stack, browser) -> None:  # noqa: F811
    """/api/docs/ (Swagger UI from drf-spectacular-sidecar, no CDN): linked from every page,
    it draws every operation of the schema with files from this server alone, and a read
    can be tried from it."""
    page = browser.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    sign_in_directly(page, stack)
    page.get_by_role("link", name="API docs").click()
    page.wait_for_selector(".opblock", timeout=20_000)
    paths = stack.get("api/schema/?format=json")["paths"]
    operations = sum(len([m for m in ops if m in ("get", "post", "put", "patch", "delete")]) for ops in paths.values())
    assert page.locator(".opblock").count() == operations
    assert requests and all(url.startswith(stack.url) for url in requests), [u for u in requests
                                                                             if not u.startswith(stack.url)]
    # Try a read: GET /api/health from the page.
    health = page.locator(".opblock-get", has=page.locator("[data-path='/api/health']"))
    health.locator(".opblock-summary").click()
    health.get_by_role("button", name="Try it out").click()
    health.get_by_role("button", name="Execute").click()
    status = health.locator(".live-responses-table tr.response .response-col_status")
    status.wait_for(timeout=10_000)
    assert status.inner_text().strip() == "200"
