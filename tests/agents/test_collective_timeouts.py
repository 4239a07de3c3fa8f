"""A rank's collectives wait long for start-up, checkpoints and switches, short in the steps
between (agents/runtime/collective_timeouts.py): on real gloo groups, the default one and a
subgroup, rank 1 never joining the second all-reduce (a cut link)."""
from __future__ import annotations

import time

from parallelism.engine.launch import run_ranks


def _waits(rank: int, world: int, mode: str) -> tuple[str, float] | None:
    import torch
    import torch.distributed as dist

    from agents.runtime.collective_timeouts import CollectiveTimeouts

    sub = dist.new_group([0, 1])
    waits = CollectiveTimeouts(long_seconds=8.0, short_seconds=1.0)
    getattr(waits, mode)()
    x = torch.ones(2)
    dist.all_reduce(x, group=sub)
    dist.all_reduce(x)
    if rank == 1:
        time.sleep(4.0)  # silent, as a host cut off: rank 0's next collective hears nothing
        return None
    out = []
    for group in (sub, None):
        start = time.perf_counter()
        try:
            dist.all_reduce(x, group=group)
            out.append(("done", time.perf_counter() - start))
        except RuntimeError as exc:
            out.append((type(exc).__name__ + (" timed out" if "Timed out" in str(exc) else ""),
                        time.perf_counter() - start))
    return out


def test_steady_waits_give_up_on_a_silent_peer_within_the_short_timeout() -> None:
    results = run_ranks(2, _waits, "steady", timeout_s=30)
    (sub_kind, sub_s), (world_kind, world_s) = results[0]
    assert sub_kind == world_kind == "RuntimeError timed out"
    assert 0.9 <= sub_s < 2.5 and 0.9 <= world_s < 2.5, results[0]


def test_patient_waits_outlast_a_peer_busy_for_longer_than_the_short_timeout() -> None:
    # Rank 1 is back after 4 s (a checkpoint being written): rank 0 waited for it, long.
    results = run_ranks(2, _busy, timeout_s=30)
    assert results[0][0] == "done" and results[0][1] >= 3.0, results[0]


def _busy(rank: int, world: int):
    import torch
    import torch.distributed as dist

    from agents.runtime.collective_timeouts import CollectiveTimeouts

    waits = CollectiveTimeouts(long_seconds=8.0, short_seconds=1.0)
    waits.steady()
    waits.patient()  # around a checkpoint
    x = torch.ones(2)
    dist.all_reduce(x)
    if rank == 1:
        time.sleep(4.0)
    start = time.perf_counter()
    dist.all_reduce(x)
    return ("done", time.perf_counter() - start)
