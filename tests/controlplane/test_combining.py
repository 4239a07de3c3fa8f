"""Flat combining (controlplane/common/combining.py), with real threads: what is handed in while
another group is applied goes in the next group, each submitter gets its own result, and a group
that raises is applied item by item so that an error reaches only its own submitter."""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.common.combining import Combiner



def _submitter(combiner: Combiner, results: dict, expected: type[Exception]):
    """submit(item) for a thread: its result, or the `expected` error it raised, in results[item]."""
    def submit(item):
        try:
            results[item] = combiner.submit(item)
        except expected as exc:
            results[item] = exc
    return submit

def test_a_lone_item_is_applied_at_once_in_a_group_of_one() -> None:
    groups = []
    combiner = Combiner(lambda items: (groups.append(list(items)), [i * 2 for i in items])[1], lambda i: -1)
    assert combiner.submit(21) == 42
    assert groups == [[21]] and (combiner.groups, combiner.items) == (1, 1)


def test_what_comes_while_a_group_is_applied_is_the_next_group() -> None:
    release, first_in = threading.Event(), threading.Event()
    groups = []

    def apply_group(items):
        groups.append(sorted(items))
        if items == [0]:
            first_in.set()
            assert release.wait(10)
        return [f"done {i}" for i in items]

    combiner = Combiner(apply_group, lambda i: "alone")
    results = {}
    first = threading.Thread(target=lambda: results.__setitem__(0, combiner.submit(0)))
    first.start()
    assert first_in.wait(10)
    others = [threading.Thread(target=lambda i=i: results.__setitem__(i, combiner.submit(i))) for i in range(1, 6)]
    for thread in others:
        thread.start()
    time.sleep(0.3)  # all five are waiting for their turn
    release.set()
    for thread in [first, *others]:
        thread.join(10)
    assert groups == [[0], [1, 2, 3, 4, 5]]
    assert results == {i: f"done {i}" for i in range(6)}


def test_a_group_that_raises_is_applied_item_by_item_and_each_error_is_its_own() -> None:
    release, first_in = threading.Event(), threading.Event()

    def apply_group(items):
        if items == ["first"]:
            first_in.set()
            assert release.wait(10)
            return ["ok first"]
        raise RuntimeError("one of them is bad")

    def apply_one(item):
        if item == "bad":
            raise ValueError("bad item")
        return f"ok {item}"

    combiner = Combiner(apply_group, apply_one)
    results = {}
    submit = _submitter(combiner, results, ValueError)

    threads = [threading.Thread(target=submit, args=("first",))]
    threads[0].start()
    assert first_in.wait(10)
    threads += [threading.Thread(target=submit, args=(item,)) for item in ("a", "bad", "b")]
    for thread in threads[1:]:
        thread.start()
    time.sleep(0.3)
    release.set()
    for thread in threads:
        thread.join(10)
    assert results["first"] == "ok first" and results["a"] == "ok a" and results["b"] == "ok b"
    assert isinstance(results["bad"], ValueError)


def test_a_lone_item_whose_group_raises_gets_that_error_without_a_second_try() -> None:
    tries = []
    combiner = Combiner(lambda items: (tries.append(items), 1 / 0), lambda item: tries.append("alone"))
    with pytest.raises(ZeroDivisionError):
        combiner.submit(1)
    assert tries == [[1]]


def test_an_error_that_is_everyones_reaches_every_submitter_without_tries_alone() -> None:
    release, first_in = threading.Event(), threading.Event()
    alone = []

    def apply_group(items):
        if items == [0]:
            first_in.set()
            assert release.wait(10)
            return ["ok"]
        raise ConnectionError("the database is down")

    combiner = Combiner(apply_group, alone.append, everyones=(ConnectionError,))
    results = {}
    submit = _submitter(combiner, results, ConnectionError)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    threads[0].start()
    assert first_in.wait(10)
    for thread in threads[1:]:
        thread.start()
    time.sleep(0.3)
    release.set()
    for thread in threads:
        thread.join(10)
    assert results[0] == "ok" and all(isinstance(results[i], ConnectionError) for i in (1, 2, 3))
    assert alone == []


@settings(max_examples=20, deadline=None)
@given(items=st.lists(st.integers(-1000, 1000), min_size=1, max_size=40), threads=st.integers(1, 8))
def test_every_submitter_gets_what_applying_its_own_item_gives(items, threads) -> None:
    """Oracle: whatever the grouping, each result is the item's own (apply_one's)."""
    def apply_group(group):
        time.sleep(0.001)
        return [item * item - 1 for item in group]

    combiner = Combiner(apply_group, lambda item: item * item - 1)
    results: dict[int, int] = {}
    chunks = [list(enumerate(items))[t::threads] for t in range(threads)]
    workers = [threading.Thread(target=lambda chunk=chunk: results.update(
        {n: combiner.submit(item) for n, item in chunk})) for chunk in chunks]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert results == {n: item * item - 1 for n, item in enumerate(items)}
    assert combiner.items == len(items) and 1 <= combiner.groups <= len(items)
