"""The jobs list's view in its address (frontend/jobs_query.py): good values are the view
the page starts from, a bad one is a 400 naming the parameter and its rule (that part of the
view keeps its default, the others apply)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend.jobs_query import DEFAULT_VIEW, SEARCH_MAX, SORT_COLUMNS, STATE_FILTERS, parse_jobs_query
from tests.controlplane.conftest import embedded_json


@given(sort=st.sampled_from(list(SORT_COLUMNS)), direction=st.sampled_from(["asc", "desc", None]),
       state=st.sampled_from(["", *STATE_FILTERS]), q=st.text(max_size=SEARCH_MAX))
def test_every_good_view_parses_to_itself(sort, direction, state, q) -> None:
    params = {"sort": sort, "state": state, "q": q, "deleted": "job-9"}
    if direction:
        params["dir"] = direction
    view, problems = parse_jobs_query(params)
    assert problems == {}
    assert view == {"sort": sort, "dir": direction or SORT_COLUMNS[sort], "state": state, "q": q.strip()}


@pytest.mark.parametrize("params, field, rule", [
    ({"sort": "password"}, "sort", "sort must be one of name, model"),
    ({"dir": "up"}, "dir", "dir must be asc or desc"),
    ({"state": "exploded"}, "state", "state must be one of active, pending"),
    ({"q": "x" * (SEARCH_MAX + 1)}, "q", "at most 100 characters"),
])
def test_a_bad_value_is_named_with_its_rule(params, field, rule) -> None:
    view, problems = parse_jobs_query(params)
    assert list(problems) == [field] and rule in problems[field] and view == DEFAULT_VIEW


@pytest.mark.django_db
def test_the_page_starts_from_the_addresses_view_and_answers_400_to_a_bad_one(browser_client) -> None:
    response = browser_client.get("/jobs/?sort=name&dir=asc&state=active&q=llama")
    html = response.content.decode()
    assert response.status_code == 200 and 'id="jobs-query-error"' not in html
    assert embedded_json(html, "jobs-view") == {"sort": "name", "dir": "asc", "state": "active", "q": "llama"}
    assert 'data-sort="name" aria-sort="ascending"' in html and 'value="llama"' in html
    assert '<option value="active" selected>' in html
    bad = browser_client.get("/jobs/?state=%3Cscript%3E&sort=name")
    html = bad.content.decode()
    assert bad.status_code == 400 and 'data-field="state"' in html and "state must be one of" in html
    assert "<script>" not in html.split('id="jobs-query-error"')[1].split("</div>")[0]  # escaped
    assert embedded_json(html, "jobs-view") == {**DEFAULT_VIEW, "sort": "name", "dir": "asc"}
