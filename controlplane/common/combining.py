"""Flat combining: what several threads of one process hand in at the same time, done together
by one of them.

A Celery worker runs tasks in a pool of threads. Where each task's own work is mostly fixed cost
(a transaction: its locks, its commit, its round trips), the threads that are waiting for their
turn anyway hand their items to whichever thread applies next, and that thread applies them all
at once. Nothing waits on purpose: a lone item is applied at once, alone; under load the groups
grow by themselves with the number of threads waiting. (celery-batches groups a task's messages
on a timer instead, and pins Celery below the version this project runs.)

One group is applied at a time per combiner. If applying a group raises, each of its items is
applied alone, so an item's error (or its outcome) is its own submitter's; except an error of
the kinds named `everyones` (a database that is down), which is every submitter's at once.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Slot(Generic[T, R]):
    __slots__ = ("item", "done", "result", "error")

    def __init__(self, item: T) -> None:
        self.item = item
        self.done = False
        self.result: R | None = None
        self.error: BaseException | None = None


class Combiner(Generic[T, R]):
    """`submit(item)` returns what `apply_group` (or, after it raised, `apply_one`) made of it.
    `apply_group(items)` returns one result per item, in order."""

    def __init__(self, apply_group: Callable[[Sequence[T]], Sequence[R]], apply_one: Callable[[T], R],
                 everyones: tuple[type[BaseException], ...] = ()) -> None:
        self._apply_group, self._apply_one, self._everyones = apply_group, apply_one, everyones
        self._pending: list[_Slot[T, R]] = []
        self._pending_lock = threading.Lock()
        self._turn = threading.Lock()
        self.groups = 0  # how many groups were applied, and of how many items (for benchmarks)
        self.items = 0

    def submit(self, item: T) -> R:
        slot: _Slot[T, R] = _Slot(item)
        with self._pending_lock:
            self._pending.append(slot)
        with self._turn:
            if not slot.done:  # no applier took it while this thread waited: apply what is pending
                with self._pending_lock:
                    group, self._pending = self._pending, []
                self._apply(group)
        if slot.error is not None:
            raise slot.error
        return slot.result  # type: ignore[return-value]

    def _apply(self, group: list[_Slot[T, R]]) -> None:
        self.groups += 1
        self.items += len(group)
        try:
            results = list(self._apply_group([slot.item for slot in group]))
            if len(results) != len(group):
                raise RuntimeError(f"apply_group returned {len(results)} results for {len(group)} items")
        except BaseException as exc:
            if len(group) > 1 and isinstance(exc, Exception) and not isinstance(exc, self._everyones):
                for slot in group:  # whose error is it? each alone says
                    self._apply_alone(slot)
                return
            for slot in group:
                slot.error, slot.done = exc, True
            if not isinstance(exc, Exception):
                raise
            return
        for slot, result in zip(group, results):
            slot.result, slot.done = result, True

    def _apply_alone(self, slot: _Slot[T, R]) -> None:
        try:
            slot.result = self._apply_one(slot.item)
        except BaseException as exc:  # handed to its own submitter, raised there
            slot.error = exc
        slot.done = True
