"""Issue 6's last fault case through the whole stack: a node lost while training, its
survivors holding a replica of every state element, no checkpoint at all."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.test_stack import node_of, replace_agent, wait_stopped, restarted_agents  # noqa: F401 (fixture)
from tests.support.stack import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_killing_rank_0s_agent_while_training_goes_on_on_the_survivor_without_a_checkpoint(
        stack, restarted_agents, tmp_path) -> None:  # noqa: F811
    """tiny-gpt dp=2 over both nodes (rank 0 on node-1, rank 1 on node-2), checkpoints off.
    node-1's agent is killed with rank 0. Rank 1 outlives its world with its replica and
    waits; its agent reports it; once node-1 is marked lost the control plane orders the
    survivor to go on as rank 0 of a one-GPU world at a fresh rendezvous on node-2. The
    engine switches the state (digests verified), the restore row says what happened, and
    the job trains on from the next step: no step is redone or skipped."""
    def create(name: str, **body) -> dict:
        return stack.post("api/jobs", {"name": name, "model": "tiny-gpt", "global_batch": 12, "seq_len": 16,
                                       "checkpoint_interval": 0, **body})

    # Two one-GPU jobs take a GPU on each node, so that the dp=2 job spans both nodes.
    fillers = [create("filler-1", gpus=1), create("filler-2", gpus=1)]
    job = create("survivors", gpus=2)
    for filler in fillers:
        stack.post(f"api/jobs/{filler['id']}/stop", {})

    def read() -> dict:
        return stack.get(f"api/jobs/{job['id']}", token=True)

    def loss() -> dict:
        return stack.get(f"api/jobs/{job['id']}/live", token=True)["metrics"].get("loss", {"x": [], "y": []})

    def restores() -> list[dict]:
        return [t for t in stack.get(f"api/transitions?job={job['id']}", token=True)["results"]
                if t["kind"] == "restore"]

    killed = False
    try:
        assert [(p["rank"], p["node"]) for p in job["placement"]] == [(0, "node-1"), (1, "node-2")], job
        wait_for(lambda: len(loss()["x"]) >= 4, timeout=120)
        os.kill(node_of(stack, "node-1")["agent_pid"], signal.SIGKILL)
        killed = True
        started = time.monotonic()
        waiting, _ = wait_for(lambda: (j := read())["state"] == "restoring" and j, timeout=30)
        assert waiting["error"].startswith("node node-2 ranks 1 lost their peers (RuntimeError: ")
        assert waiting["error"].endswith("recovering on the surviving ranks if they outlived their world "
                                         "(no checkpoint)")
        row, seconds = wait_for(lambda: next((t for t in restores() if t["state"] == "committed"), None),
                                timeout=90)
        step = row["step"]
        assert row["reason"].startswith("node node-2 ranks 1 lost their peers (")
        assert row["reason"].endswith(f"at step {step}; switched on the survivors without a checkpoint (no step "
                                      f"redone): ranks 1->0 held {row['destination_layout']}, switched to "
                                      f"{row['destination_layout']} on 1 GPUs")
        assert (row["source_layout"], row["source_world"], row["destination_world"]) == ("dp=2", 2, 1)
        assert row["destination_placement"] == [{"rank": 0, "node": "node-2", "gpu": 1}]
        verification = row["verification"]
        assert verification["verified"] is True and verification["matches_plan"] is True
        assert verification["tensors"] and all(t["match"] for t in verification["tensors"])
        assert verification["survivors"] == {"ranks": [[1, 0]], "source_layout": row["destination_layout"],
                                             "step": step, "source_restore": None}
        assert row["transfer_seconds"] > 0 and row["verify_seconds"] > 0 and row["pause_seconds"] > 0
        after, _ = wait_for(lambda: (j := read())["state"] == "running" and j, timeout=60)
        assert (after["world_size"], after["error"], after["layout"]) == (1, "", row["destination_layout"])
        assert after["rendezvous"].endswith(f":{after['rendezvous'].rpartition(':')[2]}")
        assert after["rendezvous"] != job["rendezvous"]
        # The survivor trains on from its memory: the next step follows the last one, once each.
        series, _ = wait_for(lambda: (m := loss())["x"] and max(m["x"]) >= step + 3 and m, timeout=90)
        # (reports may be applied out of order: the series is compared as a set)
        assert len(set(series["x"])) == len(series["x"])
        assert set(series["x"]) >= set(range(step + 1, int(max(series["x"])) + 1))
        assert step + 1 in series["x"]
        # The lost world's own reports run from step 1 without a gap, up to what rank 0 had sent:
        # its step reports wait in its batcher for up to one window (ReportBatcher, 0.5 s), and
        # those die with it (the survivor holds those steps' state, not their reports).
        reported = int(max(x for x in series["x"] if x <= step))
        assert set(range(1, reported + 1)) <= set(series["x"])
        assert all(0 < y < 20 for y in series["y"])
        print(f"node-1 killed at step {step}; the survivor trained on {time.monotonic() - started:.1f} s later "
              f"({seconds:.1f} s to the committed restore row; paused {row['pause_seconds']:.2f} s as the survivor "
              f"saw it, transfer {row['transfer_seconds']:.3f} s, verify {row['verify_seconds']:.3f} s)")
    finally:
        wait_stopped(stack, job, read)
        if killed:
            replace_agent(stack, restarted_agents, "node-1", tmp_path / "node-1.log")
    assert {g["state"] for n in ("node-1", "node-2") for g in node_of(stack, n)["gpus"]} == {"free"}
