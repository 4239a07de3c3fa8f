"""The 404, 403 and 500 pages keep the site's navigation (they extend base.html), name
what went wrong, and leak nothing of the server; the template filters of the one formatter."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import PermissionDenied
from django.test import Client, RequestFactory
from django.views.defaults import permission_denied

from frontend.error_views import server_error
from frontend.templatetags.dynaformat import reltime

pytestmark = pytest.mark.django_db
NAV = ('href="/jobs/"', 'href="/compare/"', 'href="/api/docs/"')


def test_404_page_has_the_navigation_and_names_the_path(browser_client) -> None:
    response = browser_client.get("/jobs/999999/")
    assert response.status_code == 404
    html = response.content.decode()
    assert 'aria-label="Main"' in html and all(link in html for link in NAV)
    assert "Page not found (404)" in html and "/jobs/999999/" in html
    assert "Traceback" not in html and "site-packages" not in html


def test_404_for_a_visitor_offers_the_sign_in(db) -> None:
    html = Client().get("/no/such/page").content.decode()
    assert 'href="/accounts/login/"' in html and "Page not found (404)" in html


def test_404_under_the_api_stays_json(browser_client) -> None:
    response = browser_client.get("/api/no-such-thing")
    assert response.status_code == 404 and response.json()["detail"].startswith("no API route")


def test_403_and_500_pages_have_the_navigation(user) -> None:
    request = RequestFactory().get("/somewhere")
    request.user = user
    forbidden = permission_denied(request, PermissionDenied())
    assert forbidden.status_code == 403 and "Not allowed (403)" in forbidden.content.decode()
    assert all(link in forbidden.content.decode() for link in NAV)
    failed = server_error(request)
    html = failed.content.decode()
    assert failed.status_code == 500 and "Server error (500)" in html and all(link in html for link in NAV)
    request.user = AnonymousUser()
    assert 'href="/accounts/login/"' in server_error(request).content.decode()


def test_reltime_is_a_time_element_with_the_utc_time_on_hover() -> None:
    at = datetime.now(timezone.utc) - timedelta(minutes=3, seconds=5)
    html = str(reltime(at.isoformat()))
    assert html.startswith(f'<time datetime="{at.isoformat()}"') and ">3 min ago</time>" in html
    assert f'title="{at:%Y-%m-%d %H:%M:%S} UTC"' in html
    assert reltime(None) == "–" and reltime("yesterday-ish") == "–"
