"""The API's docs work on a machine with no internet (issue 46): Swagger UI and ReDoc load with
every request to another host refused, and no request fails."""
from __future__ import annotations

from urllib.parse import urlparse

import pytest

from tests.support.browser_pages import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(180)]


def test_swagger_and_redoc_load_with_the_network_blocked(stack, browser) -> None:  # noqa: F811
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    ours = urlparse(stack.url).netloc
    elsewhere: list[str] = []
    failed: list[str] = []

    def only_ours(route) -> None:
        if urlparse(route.request.url).netloc in (ours, ""):
            route.continue_()
        else:  # the network beyond this machine: not there
            elsewhere.append(route.request.url)
            route.abort("internetdisconnected")

    page.route("**/*", only_ours)
    page.on("requestfailed", lambda request: failed.append(f"{request.url}: {request.failure}"))
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page, stack)

    page.goto(stack.url + "api/docs/")
    page.wait_for_selector(".swagger-ui .opblock", timeout=30_000)  # the operations are drawn
    assert page.locator(".swagger-ui .opblock").count() > 20
    page.goto(stack.url + "api/redoc/")
    page.wait_for_selector("[role=menuitem], .menu-content li", timeout=30_000)  # ReDoc's side menu
    page.wait_for_load_state("networkidle")
    assert "dynaplane control plane API" in page.locator("h1").first.inner_text()
    assert elsewhere == [] and failed == [], (elsewhere, failed)
    assert errors == [], errors
