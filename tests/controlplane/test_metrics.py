"""The compact metric store: chunks fill up, then new ones start; reads return all."""
from __future__ import annotations

import pytest

from controlplane.common.errors import InvalidInput
from controlplane.jobs.metric_codec import CHUNK_POINTS, pack, unpack
from controlplane.jobs.selectors import metric_points
from controlplane.jobs.services import job_create, metrics_append, metrics_series_get

pytestmark = pytest.mark.django_db


def test_codec_round_trip_is_exact() -> None:
    values = [0.0, -1.5, 1e-300, 3.141592653589793, float(2**53)]
    assert unpack(pack(values)) == values
    assert len(pack(values)) == 8 * len(values)


def test_append_fills_chunks_and_reads_back_in_order() -> None:
    job = job_create(name="m", model="tiny-gpt", layout="dp=1")
    series = metrics_series_get(job=job, name="step_seconds", unit="s")
    assert metrics_series_get(job=job, name="step_seconds").pk == series.pk
    first = [(float(i), 0.5 + i) for i in range(CHUNK_POINTS - 10)]
    metrics_append(series_id=series.pk, xs=[x for x, _ in first], ys=[y for _, y in first])
    more = [(float(i), 0.25 * i) for i in range(CHUNK_POINTS - 10, 2 * CHUNK_POINTS + 5)]
    total = metrics_append(series_id=series.pk, xs=[x for x, _ in more], ys=[y for _, y in more])
    assert total == 2 * CHUNK_POINTS + 5
    assert list(series.chunks.values_list("first_point", "count")) == [
        (0, CHUNK_POINTS), (CHUNK_POINTS, CHUNK_POINTS), (2 * CHUNK_POINTS, 5)
    ]
    xs, ys = metric_points(series_id=series.pk)
    assert xs == [x for x, _ in first + more] and ys == [y for _, y in first + more]


def test_per_rank_series_are_separate() -> None:
    job = job_create(name="m", model="tiny-gpt", layout="dp=2")
    r0 = metrics_series_get(job=job, name="memory_bytes", rank=0)
    r1 = metrics_series_get(job=job, name="memory_bytes", rank=1)
    assert r0.pk != r1.pk


def test_mismatched_lengths_are_refused() -> None:
    job = job_create(name="m", model="tiny-gpt", layout="dp=1")
    series = metrics_series_get(job=job, name="loss")
    with pytest.raises(InvalidInput, match="2 x values but 1 y values"):
        metrics_append(series_id=series.pk, xs=[1.0, 2.0], ys=[1.0])


def test_per_step_append_of_several_series_matches_the_chunked_store(django_assert_max_num_queries) -> None:
    """job_metrics_extend with one row (one sample to several series per step, the report path) keeps the
    same chunks as metrics_append: a series started mid-way (a metric first reported later)
    and chunk boundaries crossed at different steps for different series."""
    from controlplane.jobs.services import job_metrics_extend

    job = job_create(name="m", model="tiny-gpt", layout="dp=1")
    head = metrics_series_get(job=job, name="loss", unit="")
    metrics_append(series_id=head.pk, xs=[-1.0] * 7, ys=[9.0] * 7)  # loss is 7 points ahead
    units = {"loss": "", "step_seconds": "s"}
    steps = CHUNK_POINTS + 3
    for step in range(steps):
        values = {"loss": 1.0 / (step + 1)}
        if step >= 5:
            values["step_seconds"] = 0.5 + step
        if step < 10:
            job_metrics_extend(job=job, rows=[(float(step), values)], units=units)
        else:
            # series, last chunks, new chunks, chunk update, series update: never per series
            with django_assert_max_num_queries(5):
                job_metrics_extend(job=job, rows=[(float(step), values)], units=units)
    loss = metrics_series_get(job=job, name="loss")
    seconds = metrics_series_get(job=job, name="step_seconds")
    assert seconds.unit == "s" and loss.pk == head.pk
    assert loss.points == steps + 7 and seconds.points == steps - 5
    assert list(loss.chunks.order_by("first_point").values_list("first_point", "count")) == [
        (0, CHUNK_POINTS), (CHUNK_POINTS, steps + 7 - CHUNK_POINTS)]
    xs, ys = metric_points(series_id=loss.pk)
    assert xs == [-1.0] * 7 + [float(s) for s in range(steps)] and ys[7:] == [1.0 / (s + 1) for s in range(steps)]
    xs, ys = metric_points(series_id=seconds.pk)
    assert xs == [float(s) for s in range(5, steps)] and ys == [0.5 + s for s in range(5, steps)]


@pytest.mark.parametrize("points", [1, 5, 6, CHUNK_POINTS + 5, CHUNK_POINTS + 6, 3 * CHUNK_POINTS])
def test_a_series_tail_is_the_end_of_the_whole_series(points: int) -> None:
    """metric_tail (what an elastic sweep reads of a job's step times) against metric_points: whole
    chunks from the end, at least `points` samples (all of them when there are fewer)."""
    from controlplane.jobs.selectors import metric_tail

    job = job_create(name="t", model="tiny-gpt", layout="dp=1")
    series = metrics_series_get(job=job, name="step_seconds", unit="s")
    xs = [float(i) for i in range(2 * CHUNK_POINTS + 5)]
    metrics_append(series_id=series.pk, xs=xs, ys=[x / 2 for x in xs])
    all_x, all_y = metric_points(series_id=series.pk)
    tail_x, tail_y = metric_tail(series_id=series.pk, points=points)
    assert len(tail_x) >= min(points, len(all_x)) and tail_x == all_x[len(all_x) - len(tail_x):]
    assert tail_y == all_y[len(all_y) - len(tail_y):]
    assert len(tail_x) - points < CHUNK_POINTS  # (no more than the chunks needed)
