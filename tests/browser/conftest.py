"""Playwright driving Debian's Chromium (never a downloaded browser)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("DYNAPLANE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        if os.environ.get("DYNAPLANE_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{CHROMIUM} not found and DYNAPLANE_REQUIRE_BROWSER=1 (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium to run the browser tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()
