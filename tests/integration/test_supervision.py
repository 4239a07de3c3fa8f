"""Issue 11, item 2: SIGKILL of the control-plane worker took the whole stack down (the
launcher stopped everything). The launcher now starts a dead worker, web or agent again
and the stack stays up; a job goes on training across the worker's restart."""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.support.stack import StackProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_the_launcher_starts_a_killed_worker_and_agent_again(tmp_path) -> None:
    stack = StackProcess(tmp_path / "stack", agents=1, gpus_per_agent=1, env={"DATABASE_URL": None, "REDIS_URL": None},
                         restart_agents=True)
    stack.start()
    try:
        stack.wait_ready(timeout=120)
        job = stack.post("api/jobs", {"name": "goes-on", "model": "tiny-gpt", "gpus": 1, "global_batch": 4,
                                      "seq_len": 16, "checkpoint_interval": 0})

        def steps() -> int:
            return len(stack.get(f"api/jobs/{job['id']}/live", token=True)["metrics"].get("loss", {}).get("x", []))

        wait_for(lambda: steps() >= 2, timeout=120)

        def pids() -> dict:
            return json.loads((stack.var_dir / "stack.json").read_text())["pids"]

        worker = pids()["worker"]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: pids()["worker"] != worker, timeout=30)
        assert stack.process.poll() is None  # the launcher is still up
        before = steps()
        wait_for(lambda: steps() >= before + 2, timeout=90)  # reports flow through the new worker
        assert stack.get("api/health")["status"] == "ok"
        assert stack.get(f"api/jobs/{job['id']}", token=True)["state"] == "running"

        agent = pids()["agent-node-1"]
        stack.post(f"api/jobs/{job['id']}/stop", {})
        wait_for(lambda: stack.get(f"api/jobs/{job['id']}", token=True)["state"] == "stopped", timeout=60)
        os.kill(agent, signal.SIGKILL)
        wait_for(lambda: pids()["agent-node-1"] != agent, timeout=30)
        node = wait_for(lambda: (n := stack.get("api/nodes/node-1")) and n["agent_pid"] != agent and n, timeout=60)[0]
        assert node["state"] == "healthy"
        assert "started again" in stack.output()
    finally:
        stack.stop()


def test_after_ctrl_c_and_up_again_a_job_is_settled_not_shown_running(tmp_path) -> None:
    """Issue 11, item 1: after Ctrl-C and `dynaplane up` again, a job that trained showed
    `running` at its old step with no rank process anywhere and kept its GPUs. Now within 30 s
    of the restart it is settled (no checkpoint here: failed, with the reason) and its GPUs
    are free: by the node-loss sweep when the new agent registers late, else by the
    reconciliation of what the agents report they run (controlplane/jobs/reconcile.py)."""
    var = tmp_path / "stack"
    first = StackProcess(var, agents=1, gpus_per_agent=2, env={"DATABASE_URL": None, "REDIS_URL": None})
    first.start()
    try:
        first.wait_ready(timeout=120)
        job = first.post("api/jobs", {"name": "restarted", "model": "tiny-gpt", "gpus": 2, "global_batch": 4,
                                      "seq_len": 16, "checkpoint_interval": 0})
        wait_for(lambda: len(first.get(f"api/jobs/{job['id']}/live", token=True)["metrics"]
                             .get("loss", {}).get("x", [])) >= 2, timeout=120)
    finally:
        first.stop()
    again = StackProcess(var, agents=1, gpus_per_agent=2, env={"DATABASE_URL": None, "REDIS_URL": None})
    again.start()
    try:
        again.wait_ready(timeout=120)
        settled, seconds = wait_for(lambda: (j := again.get(f"api/jobs/{job['id']}", token=True))["state"]
                                    in ("failed", "stopped") and j, timeout=30)
        assert settled["state"] == "failed" and settled["error"], settled
        assert settled["gpus"] == [] and again.get("api/health")["gpus"]["free"] == 2
        print(f"settled {settled['state']} {seconds:.1f} s after the stack was up again: {settled['error'][:120]}")
    finally:
        again.stop()
