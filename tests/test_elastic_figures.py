"""The cluster timeline (frontend/elastic_figures.py) is a pure function of the jobs' starts,
switches and ends: GPUs per job over wall-clock time, stacked, a marker per switch with its
reason on hover, "no data yet" without a started job."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from frontend.elastic_figures import MARKER_SIZE, allocation_figure, gpus_at, plotly_time
from frontend.figure_style import NO_DATA

T0 = datetime(2026, 12, 4, 21, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


SHRINK = "shrank to 2 (dp=2): job 'eval' (priority 10) needed 4 GPUs"


def jobs() -> list[dict]:
    """train-a: 4 GPUs from 0, shrunk to 2 at 60 s, grown back to 4 at 180 s; eval: 4 GPUs
    from 70 s to 170 s."""
    return [
        {"name": "train-a", "start": at(0), "gpus": 4, "end": None, "changes": [
            {"at": at(60), "gpus_from": 4, "gpus": 2, "reason": SHRINK, "kind": "resize", "transition": 7},
            {"at": at(180), "gpus_from": 2, "gpus": 4, "reason": "grew to 4 <dp=4> & more", "kind": "resize",
             "transition": 9}]},
        {"name": "eval", "start": at(70), "gpus": 4, "end": at(170), "changes": []},
    ]


def test_one_stacked_step_trace_per_job_on_the_union_of_event_times() -> None:
    figure = allocation_figure(jobs(), now=at(200))
    assert [t["name"] for t in figure["data"]] == ["train-a", "eval"]  # start order
    times = [0, 60, 70, 170, 180, 200]
    for trace in figure["data"]:
        assert trace["x"] == [plotly_time(at(s)) for s in times]
        assert trace["stackgroup"] == "gpus" and trace["line"]["shape"] == "hv"
    by_name = {t["name"]: t["y"] for t in figure["data"]}
    assert by_name == {"train-a": [4, 2, 2, 2, 4, 4], "eval": [0, 0, 4, 0, 0, 0]}
    # The stack's top never exceeds what was allocated at once: 6 while both ran.
    assert max(a + b for a, b in zip(by_name["train-a"], by_name["eval"])) == 6
    assert figure["layout"]["xaxis"]["type"] == "date" and figure["layout"]["xaxis"]["title"]["text"] == "time (UTC)"
    assert figure["layout"]["xaxis"]["exponentformat"] == "none" and figure["layout"]["yaxis"]["dtick"] == 1


def test_a_marker_per_switch_carries_its_reason_on_hover_escaped_and_wrapped() -> None:
    train = allocation_figure(jobs(), now=at(200))["data"][0]
    sizes = train["marker"]["size"]
    assert [i for i, s in enumerate(sizes) if s] == [1, 4] and sizes[1] == MARKER_SIZE
    shrink, grow = train["text"][1], train["text"][4]
    assert shrink.startswith("train-a: 4 → 2 GPUs (#7, resize)<br>shrank to 2 (dp=2): job 'eval'")
    assert "priority 10" in shrink
    assert "&lt;dp=4&gt; &amp; more" in grow and "<dp=4>" not in grow
    assert train["text"][0] == "train-a: started on 4 GPUs"
    assert train["hovertemplate"] == "%{text}<extra></extra>"
    long = allocation_figure([{"name": "j", "start": at(0), "gpus": 1, "end": None, "changes": [
        {"at": at(5), "gpus_from": 1, "gpus": 2, "reason": "word " * 40, "kind": "resize", "transition": 1}]}],
        now=at(10))["data"][0]["text"][1]
    assert all(len(line) <= 64 for line in long.split("<br>")[1:]) and long.count("<br>") >= 3


def test_an_ended_job_drops_to_zero_and_says_so() -> None:
    evaluation = allocation_figure(jobs(), now=at(200))["data"][1]
    assert evaluation["text"][3] == "eval: ended, its GPUs freed" and evaluation["y"][3] == 0
    assert evaluation["text"][0] == "eval: not running"


def test_no_started_job_is_no_data_not_made_up_axes() -> None:
    for given_jobs in ([], [{"name": "queued", "start": None, "gpus": 4, "end": None, "changes": []}]):
        figure = allocation_figure(given_jobs, now=at(0))
        assert figure["data"] == []
        assert [a["text"] for a in figure["layout"]["annotations"]] == [NO_DATA]
        assert figure["layout"]["xaxis"]["visible"] is False and figure["layout"]["yaxis"]["visible"] is False


def test_times_are_utc_without_an_offset() -> None:
    east = timezone(timedelta(hours=2))
    assert plotly_time(datetime(2026, 12, 4, 23, 0, 1, 500, tzinfo=east)) == "2026-12-04 21:00:01.000500"


@st.composite
def histories(draw):
    out = []
    for i in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, 100))
        gpus = draw(st.integers(1, 8))
        moments = sorted(draw(st.lists(st.integers(start, 300), max_size=4, unique=True)))
        changes, held = [], gpus
        for m in moments:
            new = draw(st.integers(1, 8))
            changes.append({"at": at(m), "gpus_from": held, "gpus": new, "reason": f"r{m}", "kind": "resize",
                            "transition": m})
            held = new
        end = draw(st.one_of(st.none(), st.integers(start + 1, 400)))
        out.append({"name": f"job-{i}", "start": at(start), "gpus": gpus, "end": None if end is None else at(end),
                    "changes": changes})
    return out


@given(histories())
def test_every_point_is_the_jobs_allocation_then(history) -> None:
    """Oracle: each job's y at each drawn time is gpus_at (the step function, read directly)."""
    now = at(500)
    figure = allocation_figure(history, now=now)
    by_name = {j["name"]: j for j in history}
    for trace in figure["data"]:
        job = by_name[trace["name"]]
        for x, y in zip(trace["x"], trace["y"]):
            when = datetime.strptime(x, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
            assert y == gpus_at(job, when)
        # every switch inside the drawn span has its marker
        drawn = {datetime.strptime(x, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc) for x in trace["x"]}
        marked = {c["at"] for c in job["changes"]} & drawn
        assert sum(1 for s in trace["marker"]["size"] if s) == len(marked)
