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


def _killed_in_an_all_reduce(rank: int, world: int) -> None:
    import signal

    import torch
    import torch.distributed as dist

    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer does: no traceback, no report
    dist.all_reduce(torch.ones(4))


def test_a_killed_rank_is_shown_as_the_cause_and_every_rank_is_named() -> None:
    """The ranks a killed peer takes down report its connection closed or reset; the error
    shows the killed rank first (it is the cause) and one line for every rank."""
    from parallelism.engine.errors import EngineError

    with pytest.raises(EngineError) as failure:
        run_ranks(3, _killed_in_an_all_reduce, timeout_s=30)
    message = str(failure.value)
    head, shown = message.split("\n", 1)
    assert "rank 2: rank 2 died with exit code -9" in head, message
    assert all(f"rank {r}: " in head for r in (0, 1)), message
    assert shown.startswith("rank 2 died with exit code -9"), message


def test_a_rank_that_raises_is_shown_before_a_killed_one() -> None:
    from parallelism.engine.launch import failure_rank

    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:35508: "
            "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert failure_rank("ValueError: bad shape\nTraceback ...") < failure_rank("rank 1 died with exit code -9 and no "
                                                                           "report") < failure_rank(gloo)
    assert failure_rank("RuntimeError: Connection closed by peer [127.0.0.1]:1234\n...") == failure_rank(gloo)


def _a_tensor(rank: int, world: int) -> object:
    import torch

    return {"rank": rank, "values": torch.arange(1000, dtype=torch.float32) * (rank + 1)}


def test_tensors_come_back_as_copies_not_shared_with_the_rank_process() -> None:
    """A tensor a rank returns must not be passed by file descriptor through the rank's
    resource sharer: the rank may exit before the caller reads its message (CI saw
    FileNotFoundError rebuilding one). A copy owns its memory: it is not shared."""
    import torch

    results = run_ranks(2, _a_tensor, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        assert not result["values"].is_shared()
        assert torch.equal(result["values"], torch.arange(1000, dtype=torch.float32) * (rank + 1))
