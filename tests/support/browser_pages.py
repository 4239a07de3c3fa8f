"""What browser tests do on every page: sign in as the stack's admin and wait for the live feed."""
from __future__ import annotations


def sign_in(page, stack) -> None:
    page.goto(stack.url)
    page.get_by_label("Username").fill(stack.state["username"])  # the login form: the one thing typed
    page.get_by_label("Password").fill(stack.state["password"])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_selector("#connection[data-state=live]", timeout=15_000)
