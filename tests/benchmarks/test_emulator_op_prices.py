"""The per-op price check (benchmarks/emulator_op_prices.py): its timed recorder and its sums."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.emulator_op_prices import by_name, median_per_op, priced, timed_recorder
from parallelism.emulator.costs import compute_seconds
from parallelism.emulator.devices import get_profile
from parallelism.emulator.recorder import OpRecorder
from parallelism.emulator.trace import ComputeOp


def program() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64, dtype=torch.bfloat16)
    c = torch.mm(a, a)
    c.add_(b)
    torch.nn.functional.silu(c).sum()


def test_the_timed_recorder_records_what_the_tracers_recorder_does_and_times_each_op() -> None:
    plain, timed = OpRecorder(), timed_recorder()
    with plain:
        program()
    with timed:
        program()
    assert [(r.name, r.kind, r.bytes, r.flops, r.source) for r in timed.records] == \
        [(r.name, r.kind, r.bytes, r.flops, r.source) for r in plain.records]
    assert len(timed.seconds) == len(timed.records) > 0
    assert all(0 < s < 1 for s in timed.seconds)


def test_each_record_is_priced_as_the_trace_prices_the_op_made_of_it() -> None:
    recorder = OpRecorder()
    with recorder:
        program()
    cpu = get_profile("cpu")
    expected = [compute_seconds(ComputeOp(r.name, r.kind, r.flops, r.bytes, r.shape, r.dtype, r.form, r.role,
                                          r.source), cpu) for r in recorder.records]
    assert priced(recorder.records, cpu) == expected


@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=30))
def test_sums_by_name_keep_every_op_and_put_the_largest_miss_first(ops) -> None:
    names, real, price = (list(x) for x in zip(*ops))
    rows = by_name(names, real, price)
    assert sum(n for _, n, _, _ in rows) == len(ops)
    assert {name for name, *_ in rows} == set(names)
    for name, n, r, p in rows:
        assert n == names.count(name)
        assert r == pytest.approx(sum(x for m, x in zip(names, real) if m == name))
        assert p == pytest.approx(sum(x for m, x in zip(names, price) if m == name))
    misses = [abs(p - r) for _, _, r, p in rows]
    assert misses == sorted(misses, reverse=True)


def test_each_ops_median_is_over_steps() -> None:
    assert median_per_op([[1.0, 5.0], [3.0, 4.0], [2.0, 9.0]]) == [2.0, 5.0]
    with pytest.raises(ValueError):
        median_per_op([[1.0], [1.0, 2.0]])  # steps that ran different ops cannot be paired
