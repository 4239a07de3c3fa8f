"""Events put back in seq order before a page sees them (controlplane/common/seq_order.py):
property tests against the obvious oracle, any arrival order and any losses."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.common.seq_order import InOrder


@given(st.permutations(list(range(1, 30))))
def test_any_arrival_order_is_released_in_seq_order_with_nothing_lost(arrival: list[int]) -> None:
    order, out = InOrder(0), []
    for seq in arrival:
        out += order.arrive({"seq": seq})
    assert [e["seq"] for e in out] == list(range(1, 30)) and not order.waiting


@given(st.permutations(list(range(1, 30))), st.sets(st.integers(1, 29)))
def test_with_losses_what_arrives_is_released_in_order_once_the_hold_expires(arrival: list[int],
                                                                             lost: set[int]) -> None:
    order, out = InOrder(0), []
    for seq in arrival:
        if seq not in lost:
            out += order.arrive({"seq": seq})
    out += order.release()
    got = [e["seq"] for e in out]
    assert got == sorted(set(range(1, 30)) - lost)  # every event once, in order
    assert not order.waiting and (not got or order.last == got[-1])


def test_an_event_from_before_the_hello_passes_as_it_is() -> None:
    order = InOrder(10)
    assert order.arrive({"seq": 9}) == [{"seq": 9}]
    assert order.arrive({"seq": 12}) == [] and order.waiting
    assert [e["seq"] for e in order.arrive({"seq": 11})] == [11, 12]
