"""Transition.progress merging is independent of the order the reports arrive in."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agents import protocol
from controlplane.jobs.transfer_progress import merge_progress


def _reports(rounds: int) -> list[protocol.TransferProgress]:
    """Rank 0's live reports (its wave so far) and the committed one (every rank's full wave)."""
    wave = [10 + i for i in range(2 * rounds + 1)]
    live = [protocol.TransferProgress(round=k, rounds=rounds, moved_bytes=100 * k, waves={0: wave[:2 * k + 1]})
            for k in range(1, rounds + 1)]
    final = protocol.TransferProgress(round=rounds, rounds=rounds, moved_bytes=100 * rounds,
                                      waves={0: wave, 1: [5] * len(wave)})
    return [*live, final]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6).flatmap(lambda r: st.permutations(_reports(r))))
def test_any_arrival_order_gives_the_furthest_progress(reports) -> None:
    stored: dict = {}
    for report in reports:
        stored = merge_progress(stored, report)
    rounds = reports[0].rounds
    assert stored["round"] == stored["rounds"] == rounds and stored["moved_bytes"] == 100 * rounds
    assert stored["waves"] == {"0": [10 + i for i in range(2 * rounds + 1)], "1": [5] * (2 * rounds + 1)}
    assert list(stored["waves"]) == ["0", "1"]
