"""run_ranks forks its ranks from a forkserver that imported torch once: each rank must still
see the caller's environment as of the call (not the server's from its start), the heap
settings, and a torch with no process group left from an earlier run."""
from __future__ import annotations

import os

import pytest

from parallelism.engine.launch import RANK_MALLOC_ENV, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _environment(rank: int, world: int, names: list[str]) -> dict:
    import torch.distributed as dist

    return {"env": {name: os.environ.get(name) for name in names}, "world": dist.get_world_size(),
            "groups": len(dist.distributed_c10d._world.pg_map)}


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch) -> None:
    run_ranks(1, _environment, [], timeout_s=60)  # the server runs now, started without this variable
    monkeypatch.setenv("DYNAPLANE_TEST_LAUNCH", "set after the forkserver started")
    for name in RANK_MALLOC_ENV:
        monkeypatch.delenv(name, raising=False)
    results = run_ranks(2, _environment, ["DYNAPLANE_TEST_LAUNCH", *RANK_MALLOC_ENV], timeout_s=60)
    for result in results:
        assert result["env"] == {"DYNAPLANE_TEST_LAUNCH": "set after the forkserver started", **RANK_MALLOC_ENV}
        assert result["world"] == 2 and result["groups"] == 1  # only this run's default group
    assert not any(name in os.environ for name in RANK_MALLOC_ENV)  # the caller's own left as it was


def test_a_variable_removed_by_the_caller_is_gone_in_the_ranks(monkeypatch) -> None:
    monkeypatch.setenv("DYNAPLANE_TEST_LAUNCH_GONE", "1")
    assert run_ranks(1, _environment, ["DYNAPLANE_TEST_LAUNCH_GONE"], timeout_s=60)[0]["env"] == {
        "DYNAPLANE_TEST_LAUNCH_GONE": "1"}
    monkeypatch.delenv("DYNAPLANE_TEST_LAUNCH_GONE")
    assert run_ranks(1, _environment, ["DYNAPLANE_TEST_LAUNCH_GONE"], timeout_s=60)[0]["env"] == {
        "DYNAPLANE_TEST_LAUNCH_GONE": None}
