"""The jobs list's view in its address (?sort=&dir=&state=&q=): checked here, applied in
the browser (jobs-view.js), so a shared link shows the same list. Pure."""
from __future__ import annotations

from collections.abc import Mapping

from controlplane.jobs.lifecycle import JobState

# column -> the direction a first click sorts it by (words A-Z; numbers and times largest first).
# "elastic" sorts by (policy on, most GPUs, fewest GPUs) as jobs-view.js says; the table
# shows the columns in this order.
SORT_COLUMNS = {"name": "asc", "model": "asc", "layout": "asc", "gpus": "desc", "state": "asc", "step": "desc",
                "loss": "asc", "switches": "desc", "elastic": "desc", "priority": "desc", "created": "desc"}
DIRECTIONS = ("asc", "desc")
ACTIVE = "active"  # every live state (starting, running, switching, restoring, stopping)
STATE_FILTERS = (ACTIVE, *(s.value for s in JobState))
SEARCH_MAX = 100
DEFAULT_VIEW = {"sort": "created", "dir": "desc", "state": "", "q": ""}


def parse_jobs_query(params: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the view, problems: field -> the rule it broke). A field with a problem keeps its
    default; other parameters (e.g. `deleted`) are not the view's."""
    view, problems = dict(DEFAULT_VIEW), {}
    sort = params.get("sort")
    if sort is not None:
        if sort in SORT_COLUMNS:
            view["sort"], view["dir"] = sort, SORT_COLUMNS[sort]
        else:
            problems["sort"] = f"sort must be one of {', '.join(SORT_COLUMNS)}; got {sort[:40]!r}"
    direction = params.get("dir")
    if direction is not None:
        if direction in DIRECTIONS:
            view["dir"] = direction
        else:
            problems["dir"] = f"dir must be asc or desc; got {direction[:40]!r}"
    state = params.get("state")
    if state:
        if state in STATE_FILTERS:
            view["state"] = state
        else:
            problems["state"] = f"state must be one of {', '.join(STATE_FILTERS)}; got {state[:40]!r}"
    search = params.get("q")
    if search is not None:
        if len(search) > SEARCH_MAX:
            problems["q"] = f"q (the search) must be at most {SEARCH_MAX} characters; got {len(search)}"
        else:
            view["q"] = search.strip()
    return view, problems
