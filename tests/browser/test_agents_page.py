"""The Agents page in a real browser (issue 44): the admin issues a token for a node by the form,
sees it once with the command for the agent's host, the token enrols an agent (POST
/api/agents/join), and Revoke (asked first) makes the control plane refuse it."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.support.browser_pages import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(180)]


def join(stack, token: str) -> int:
    request = urllib.request.Request(stack.url + "api/agents/join", data=json.dumps({"token": token}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_issue_a_token_by_the_form_enrol_with_it_and_revoke_it(stack, browser) -> None:  # noqa: F811
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page, stack)
    page.get_by_role("link", name="Agents").click()
    page.wait_for_selector("#issue-form")
    page.get_by_label("Node").fill("Bad_Name")
    page.get_by_role("button", name="Issue token").click()
    page.wait_for_selector("#error-node:not([hidden])")
    assert "lowercase DNS label" in page.locator("#error-node").inner_text()
    page.get_by_label("Node").fill("gpu-42")
    page.get_by_label("Note").fill("rack 9")
    page.get_by_role("button", name="Issue token").click()
    page.wait_for_selector("#issued:not([hidden])")
    token = page.locator("#issued-token").inner_text().strip()
    assert token.startswith("dpa_") and f"DYNAPLANE_AGENT_TOKEN={token} dynaplane agent --join {stack.url}" in \
        page.locator("#issued-command").inner_text()
    key_id = token.split("_")[1]
    assert page.locator(f"#token-{key_id} [data-field=state]").inner_text() == "valid"
    assert join(stack, token) == 200
    page.reload()  # the secret is never shown again
    assert token not in page.content() and page.locator(f"#token-{key_id}").count() == 1
    page.locator(f"[data-revoke='{key_id}']").click()
    assert f"Revoke token {key_id} of node gpu-42?" in page.locator("#revoke-dialog-text").inner_text()
    page.get_by_role("button", name="Revoke token").click()
    page.wait_for_function(f"document.querySelector('#token-{key_id} [data-field=state]').textContent"
                           ".startsWith('revoked')")
    assert join(stack, token) == 403
    page.screenshot(path=str(stack.var_dir / "agents-page.png"), full_page=True)
    assert errors == [], errors
