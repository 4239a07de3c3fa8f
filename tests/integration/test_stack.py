"""The whole stack as separate processes: web, control worker + beat, agents, Redis."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from websockets.sync.client import connect

from controlplane.cluster.events import cluster_event_adapter
from agents.runtime.sample_log import read_records
from tests.support.datasets import assert_each_sample_read_once, real_text_dataset
from tests.support.stack import ROOT, StackProcess, wait_for, wait_for_transition_end

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def node_of(stack, name: str) -> dict:
    return stack.get(f"api/nodes/{name}")


def job_reads(stack, job: dict):
    """(read, live): GET the job, GET its live metrics."""
    return (lambda: stack.get(f"api/jobs/{job['id']}", token=True),
            lambda: stack.get(f"api/jobs/{job['id']}/live", token=True))


def test_health_and_inventory(stack) -> None:
    health = stack.get("api/health")
    assert health["status"] == "ok"
    assert health["agents"] == {"healthy": 2, "lost": 0}
    assert health["gpus"]["total"] == 4 and health["gpus"]["free"] == 4
    nodes = stack.get("api/nodes")["results"]
    assert [n["name"] for n in nodes] == ["node-1", "node-2"]
    for node in nodes:
        assert node["state"] == "healthy" and node["device"] == "cpu"
        assert node["agent_pid"] == stack.child_pids()[f"agent-{node['name']}"]
        assert [(g["index"], g["model_name"], g["state"]) for g in node["gpus"]] == [
            (0, "virtual-cpu", "free"), (1, "virtual-cpu", "free")
        ]
    print(f"stack ready (health ok, 2 agents) {stack.ready_seconds:.1f} s after start")


def test_real_websocket_client_gets_live_events(stack) -> None:
    url = stack.url.replace("http://", "ws://") + "ws/cluster/"
    with connect(url, additional_headers={"Authorization": f"Token {stack.state['token']}"},
                 origin=stack.url.rstrip("/"), open_timeout=10) as socket:
        hello = cluster_event_adapter.validate_python(json.loads(socket.recv(timeout=10)))
        assert hello.type == "hello"
        created = stack.post("api/jobs", {"name": "ws-job", "model": "tiny-gpt", "layout": "tp=2,dp=2",
                                          "start": False})
        # Node events (heartbeats carry CPU and memory) may come first; the job's event must follow.
        deadline, event = time.monotonic() + 10, None
        while event is None or event.type != "job":
            event = cluster_event_adapter.validate_python(
                json.loads(socket.recv(timeout=max(0.1, deadline - time.monotonic()))))
        assert (event.type, event.op, event.job.id, event.job.gpus) == ("job", "upsert", created["id"], 4)
        assert event.seq > hello.seq


def test_an_emulation_posted_to_the_api_runs_on_an_agent(stack) -> None:
    """POST /api/emulations -> the `emulate` queue -> an agent traces and simulates -> the
    run is done with the `dynaplane emulate --json` result, progress seen on /ws/emulations/."""
    url = stack.url.replace("http://", "ws://") + "ws/emulations/"
    with connect(url, additional_headers={"Authorization": f"Token {stack.state['token']}"},
                 origin=stack.url.rstrip("/"), open_timeout=10) as socket:
        json.loads(socket.recv(timeout=10))  # hello
        started = time.monotonic()
        (run,) = stack.post("api/emulations", {"model": "tiny-gpt", "layout": "tp=2,pp=2,dp=2,zero=1", "gpus": 8,
                                               "gpu_type": "h100", "global_batch": 16, "micro_batch": 2,
                                               "seq_len": 32})["runs"]
        states = []
        while not states or states[-1] not in ("done", "failed"):
            event = json.loads(socket.recv(timeout=150))
            if event["type"] == "emulation" and event["run"]["id"] == run["id"]:
                states.append(event["run"]["state"])
        seconds = time.monotonic() - started
    assert states[0] == "queued" and "running" in states and states[-1] == "done", states
    done = stack.get(f"api/emulations/{run['id']}")
    assert done["state"] == "done" and done["result"]["ranks_emulated"] == 8
    assert done["result"]["step_seconds"] > 0 and done["result"]["memory"]["per_stage"]
    print(f"emulation queued -> done through an agent in {seconds:.1f} s")


def test_a_job_trains_on_the_agents_and_stops_on_request(stack) -> None:
    """POST /api/jobs with a GPU count -> GPUs allocated across the agents -> rank processes
    train tiny-gpt in one gloo world and rank 0's step metrics reach the job's series ->
    POST stop -> every rank leaves after the same step and the GPUs are free again."""
    started = time.monotonic()
    job = stack.post("api/jobs", {"name": "e2e", "model": "tiny-gpt", "gpus": 4, "global_batch": 4,
                                  "seq_len": 16})
    assert job["state"] == "starting" and job["layout"] == "dp=4"
    assert sorted({p["node"] for p in job["placement"]}) == ["node-1", "node-2"]

    def read() -> dict:
        return stack.get(f"api/jobs/{job['id']}", token=True)

    try:
        wait_for(lambda: read()["state"] == "running", timeout=90)
        metrics, _ = wait_for(lambda: len((m := stack.get(f"api/jobs/{job['id']}/live", token=True)["metrics"])
                                          .get("loss", {}).get("y", [])) >= 3 and m, timeout=60)
        assert metrics["loss"]["x"][:3] == [1, 2, 3] and all(5 < v < 8 for v in metrics["loss"]["y"][:3])
        assert all(v > 0 for v in metrics["tokens_per_second"]["y"])
        # The agents report the job's live rank processes in their heartbeats (the observed state).
        where = {p["node"]: sorted(s["rank"] for s in job["placement"] if s["node"] == p["node"])
                 for p in job["placement"]}
        for name, ranks in where.items():
            wait_for(lambda: node_of(stack, name)["running_jobs"].get(str(job["id"])) == ranks, timeout=10)
        print(f"job running with step metrics {time.monotonic() - started:.1f} s after POST /api/jobs")
        stack.post(f"api/jobs/{job['id']}/stop", {})
        stopped, seconds = wait_for(lambda: (j := read())["state"] == "stopped" and j, timeout=60)
        assert stopped["gpus"] == []
        assert stack.get("api/health")["gpus"]["free"] == 4
        for name in where:
            wait_for(lambda: str(job["id"]) not in node_of(stack, name)["running_jobs"], timeout=10)
        print(f"job stopped {seconds:.1f} s after POST stop")
    finally:
        wait_stopped(stack, job, read)


def test_a_job_resizes_online_from_two_to_four_and_back_to_three_gpus(stack) -> None:
    """Issue 6's main path through the whole stack: the control plane plans each resize and
    sends the switch orders, the agents start the joining ranks while the job trains, the
    ranks switch at a step boundary and verify every tensor, the history keeps both rows
    with their timings, and the GPUs of the leaving rank are free again. On real text
    (issue 42): the ranks' records of what they read show every sample of the run's range
    read once, in order, the samples an unswitched run reads."""
    directory = real_text_dataset(stack, "stdlib-code")
    job = stack.post("api/jobs", {"name": "elastic", "model": "tiny-gpt", "gpus": 2, "global_batch": 12,
                                  "seq_len": 16, "dataset": "stdlib-code"})

    read, live = job_reads(stack, job)

    try:
        _resize_two_to_four_to_three(stack, job, read, live)
    finally:
        wait_stopped(stack, job, read)
    assert_each_sample_read_once(read(), directory, 12, 16)
    layouts = {r["layout"] for r in read_records(read()["checkpoint_dir"]) if "step" in r}
    assert {"dp=2", "dp=4", "dp=3"} <= layouts, layouts


def wait_stopped(stack, job: dict, read) -> None:
    """Stop a test's job (also when the test failed: later tests need the GPUs free)."""
    if read()["state"] in ("starting", "running", "switching", "restoring"):
        stack.post(f"api/jobs/{job['id']}/stop", {})
    wait_for(lambda: read()["state"] in ("stopped", "failed"), timeout=60)


def _resize_two_to_four_to_three(stack, job: dict, read, live) -> None:
    wait_for(lambda: read()["state"] == "running", timeout=90)
    wait_for(lambda: len(live()["metrics"].get("loss", {}).get("y", [])) >= 2, timeout=60)
    timings = []
    for gpus, layout in ((4, "dp=4"), (3, "dp=3")):
        transition = stack.post(f"api/jobs/{job['id']}/resize", {"gpus": gpus})
        assert transition["destination_layout"] == layout, transition
        done, seconds = wait_for_transition_end(stack, transition['id'])
        assert done["state"] == "committed", done
        assert done["verification"]["verified"] is True
        # Every state in order; rank 0 reports each, but the control worker's threads may apply
        # two reports sent milliseconds apart out of order (the earlier state is then recorded
        # as passed, not reported).
        assert [h["state"] for h in done["history"]] == [
            "planned", "preparing", "ready", "transferring", "verifying", "committed"], done["history"]
        assert done["history"][-1]["reported"] is True
        assert done["transfer_seconds"] > 0 and done["pause_seconds"] >= done["transfer_seconds"]
        # Growing sends the new replicas their state; shrinking plain data parallelism moves
        # nothing (every staying rank already holds a full replica).
        assert done["prepare_seconds"] > 0 and (done["network_bytes"] > 0) == (gpus == 4), done
        timings.append((layout, seconds, done["prepare_seconds"], done["pause_seconds"]))
        wait_for(lambda: read()["state"] == "running" and read()["layout"] == layout, timeout=30)
    assert read()["world_size"] == 3 and len(read()["gpus"]) == 3
    assert stack.get("api/health")["gpus"]["free"] == 1
    history = stack.get(f"api/transitions?job={job['id']}", token=True)["results"]
    assert sorted(t["destination_layout"] for t in history) == ["dp=3", "dp=4"]
    metrics = live()["metrics"]
    steps, losses = metrics["loss"]["x"], metrics["loss"]["y"]
    # Training went on across both switches: every step once, the loss finite and falling.
    # (The control worker's threads may apply two step reports out of order: compared sorted.)
    assert sorted(steps) == list(range(1, len(steps) + 1)), steps
    assert all(0 < v < losses[0] + 0.5 for v in losses) and losses[-1] < losses[0] - 0.5, losses
    stack.post(f"api/jobs/{job['id']}/stop", {})
    wait_for(lambda: read()["state"] == "stopped", timeout=60)
    assert stack.get("api/health")["gpus"]["free"] == 4
    for layout, seconds, prepare, pause in timings:
        print(f"resize to {layout}: committed {seconds:.1f} s after POST; preparation {prepare:.1f} s "
              f"(hidden behind training), pause {pause:.3f} s")


def test_a_resize_under_a_device_map_renumbers_ranks_and_keeps_training(stack) -> None:
    """pp=2,dp=2 -> pp=2 -> pp=2,dp=2 on 2 nodes x 2 GPUs. Shrinking, the device map gives
    rank 1 (stage 1) to process 2 on node-2, which holds stage 1 already: nothing crosses
    the network (the contract's order would move the whole stage). That process forms the
    new world as rank 1 and its agent renumbers it; growing again then starts the joining
    processes beside it and maps the ranks once more. Every switch verified, every step once."""
    job = stack.post("api/jobs", {"name": "mapped", "model": "tiny-gpt", "layout": "pp=2,dp=2", "global_batch": 12,
                                  "seq_len": 16})

    read, live = job_reads(stack, job)

    try:
        wait_for(lambda: read()["state"] == "running", timeout=90)
        wait_for(lambda: len(live()["metrics"].get("loss", {}).get("y", [])) >= 2, timeout=60)
        for layout in ("pp=2", "pp=2,dp=2"):
            transition = stack.post(f"api/jobs/{job['id']}/resize", {"layout": layout})
            assert transition["process_of"] is not None and transition["process_of"][0] == 0, transition
            done, _ = wait_for_transition_end(stack, transition["id"])
            assert done["state"] == "committed" and done["verification"]["verified"] is True, done
            assert done["verification"]["matches_plan"] is True, done
            assert done["network_bytes"] == transition["plan_summary"]["network_bytes"]
            assert done["network_bytes"] < transition["plan_summary"]["contract_order_network_bytes"]
            if layout == "pp=2":
                assert done["network_bytes"] == 0
                assert [(s["node"], s["gpu"]) for s in done["destination_placement"]] == [
                    ("node-1", 0), ("node-2", 0)]
            wait_for(lambda: read()["state"] == "running" and read()["layout"] == layout, timeout=30)
            steps_then = len(live()["metrics"]["loss"]["y"])
            wait_for(lambda: len(live()["metrics"]["loss"]["y"]) >= steps_then + 2, timeout=60)  # it trains on
        metrics = live()["metrics"]
        steps, losses = metrics["loss"]["x"], metrics["loss"]["y"]
        assert sorted(steps) == list(range(1, len(steps) + 1)), steps
        assert all(0 < v < losses[0] + 0.5 for v in losses), losses
    finally:
        wait_stopped(stack, job, read)
    assert read()["state"] == "stopped"
    assert stack.get("api/health")["gpus"]["free"] == 4


@pytest.fixture(scope="module")
def restarted_agents():
    """Agents a test started again after killing them: they live until the module's stack
    stops (later tests expect every node healthy)."""
    started: list[subprocess.Popen] = []
    yield started
    for agent in started:
        try:
            os.killpg(agent.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        agent.wait(timeout=20)


def test_killing_the_joining_agent_while_a_resize_prepares_keeps_the_job_training(stack, restarted_agents,
                                                                                  tmp_path) -> None:
    """Issue 6's fault test: the agent that should host the joining ranks dies while the
    resize is being prepared. Its node is lost, the resize is aborted with the reason, the
    job never leaves its layout and trains on; its GPUs stay its own."""
    job = stack.post("api/jobs", {"name": "fault", "model": "tiny-gpt", "gpus": 2, "global_batch": 12,
                                  "seq_len": 16})

    def read() -> dict:
        return stack.get(f"api/jobs/{job['id']}", token=True)

    def steps() -> list:
        return stack.get(f"api/jobs/{job['id']}/live", token=True)["metrics"].get("loss", {}).get("x", [])

    killed = False
    try:
        wait_for(lambda: read()["state"] == "running" and len(steps()) >= 2, timeout=90)
        assert {p["node"] for p in read()["placement"]} == {"node-1"}
        transition = stack.post(f"api/jobs/{job['id']}/resize", {"gpus": 4})
        assert {p["node"] for p in transition["destination_placement"] if p["rank"] >= 2} == {"node-2"}
        wait_for(lambda: stack.get(f"api/transitions/{transition['id']}", token=True)["state"] == "preparing", timeout=30)
        os.kill(stack.child_pids()["agent-node-2"], signal.SIGKILL)
        killed = True
        done, seconds = wait_for(
            lambda: (t := stack.get(f"api/transitions/{transition['id']}", token=True))["state"] == "aborted" and t,
            timeout=60)
        assert "node node-2 (joining ranks 2, 3) lost before the transfer" in done["reason"]
        after = read()
        assert (after["state"], after["layout"], after["world_size"], after["error"]) == ("running", "dp=2", 2, "")
        seen = len(steps())
        wait_for(lambda: len(steps()) >= seen + 3, timeout=60)  # still training
        print(f"resize aborted {seconds:.1f} s after the joining agent was killed; the job trained on")
    finally:
        wait_stopped(stack, job, read)
        if killed:  # later tests expect node-2 back
            env = {**os.environ, **stack.agent_env("node-2")}
            restarted_agents.append(subprocess.Popen(
                [sys.executable, "-m", "dynaplane", "agent", "--name", "node-2", "--gpus", "2"], env=env, cwd=ROOT,
                stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True))
            wait_for(lambda: node_of(stack, "node-2")["state"] == "healthy", timeout=30)
    assert {g["state"] for g in node_of(stack, "node-2")["gpus"]} == {"free"}


def _agent(stack, name: str, log: Path, **env: str) -> subprocess.Popen:
    """Start agent `name` (again), with extra environment for its rank processes."""
    env = {**os.environ, **stack.agent_env(name), "DYNAPLANE_VAR_DIR": str(log.parent / name), **env}
    return subprocess.Popen([sys.executable, "-m", "dynaplane", "agent", "--name", name, "--gpus", "2"], env=env,
                            cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def replace_agent(stack, restarted_agents, name: str, log: Path, **env: str) -> None:
    """Kill agent `name` (whichever process runs it now) and start it again with `env`."""
    try:
        os.kill(node_of(stack, name)["agent_pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass
    agent = _agent(stack, name, log, **env)
    restarted_agents.append(agent)
    wait_for(lambda: (n := node_of(stack, name))["state"] == "healthy" and n["agent_pid"] == agent.pid, timeout=60)


def test_killing_the_joining_agent_during_the_transfer_rolls_back_at_once(stack, restarted_agents,
                                                                          tmp_path) -> None:
    """Issue 11, item 3: the joining ranks' agent dies while the state moves (a joining rank
    holds the union world, by fault injection). Its rank processes die with it; the old
    ranks see their peers gone, roll back to the old layout with the state they kept, and
    train on: the transition ends rolled back long before any collective time-out, and the
    health check names the lost node."""
    replace_agent(stack, restarted_agents, "node-2", tmp_path / "node-2.log",
                  DYNAPLANE_FAULT="hold-in-transfer:2:120")
    job = stack.post("api/jobs", {"name": "lost-joiner", "model": "tiny-gpt", "gpus": 2, "global_batch": 12,
                                  "seq_len": 16})
    read, live = job_reads(stack, job)

    def steps() -> list:
        return live()["metrics"].get("loss", {}).get("x", [])

    try:
        wait_for(lambda: read()["state"] == "running" and len(steps()) >= 2, timeout=90)
        transition = stack.post(f"api/jobs/{job['id']}/resize", {"gpus": 4})
        assert {p["node"] for p in transition["destination_placement"] if p["rank"] >= 2} == {"node-2"}
        wait_for(lambda: stack.get(f"api/transitions/{transition['id']}", token=True)["state"] == "transferring",
                 timeout=90)
        os.kill(node_of(stack, "node-2")["agent_pid"], signal.SIGKILL)
        done, seconds = wait_for(
            lambda: (t := stack.get(f"api/transitions/{transition['id']}", token=True))["state"]
            in ("rolled_back", "aborted", "failed", "committed") and t, timeout=60)
        assert done["state"] == "rolled_back", done
        assert seconds < 15, f"rolled back {seconds:.1f} s after the joining agent died"
        after = read()
        assert (after["state"], after["layout"], after["world_size"], after["error"]) == ("running", "dp=2", 2, "")
        assert {p["node"] for p in after["placement"]} == {"node-1"}
        seen = len(steps())
        _, trained = wait_for(lambda: len(steps()) >= seen + 3, timeout=30)  # training goes on
        health, _ = wait_for(lambda: (h := stack.get("api/health"))["agents"]["lost"] == 1 and h, timeout=30)
        assert health["status"] == "degraded" and any("node-2" in w for w in health["warnings"]), health
        print(f"resize rolled back {seconds:.1f} s after the joining agent was killed mid-transfer; "
              f"3 more steps {trained:.1f} s later")
    finally:
        wait_stopped(stack, job, read)


def test_killing_an_agent_under_a_training_job_leaves_it_training_on_the_survivors(stack) -> None:
    """Issue 11: an agent SIGKILLed while a dp=3 job trains on its node and another. Its rank
    dies with it; the ranks on the other node hold a full replica, outlive their broken world
    and switch onto dp=2 among themselves, from memory: within 30 s the job trains again,
    the lost step's state intact (the survivors' switch verified), the lost node's GPU
    no longer the job's."""
    directory = real_text_dataset(stack, "stdlib-code")
    job = stack.post("api/jobs", {"name": "survives", "model": "tiny-gpt", "gpus": 3, "global_batch": 12,
                                  "seq_len": 16, "checkpoint_interval": 0, "dataset": "stdlib-code"})
    read, live = job_reads(stack, job)

    def steps() -> list:
        return live()["metrics"].get("loss", {}).get("x", [])

    try:
        wait_for(lambda: read()["state"] == "running" and len(steps()) >= 2, timeout=90)
        lost = next(n for n in ("node-1", "node-2") if [p["node"] for p in read()["placement"]].count(n) == 1)
        os.kill(node_of(stack, lost)["agent_pid"], signal.SIGKILL)
        killed = time.monotonic()
        last = max(steps())
        # Steps of the old world may still be on their way (rank 0 batches its reports): the job
        # trains again when it runs on the survivors' layout and a step beyond the last one seen arrives.
        wait_for(lambda: any(step > last for step in steps()) and (r := read())["state"] == "running"
                 and r["layout"] != "dp=3", timeout=60)
        seconds = time.monotonic() - killed
        after = read()
        assert seconds < 30, f"training again {seconds:.1f} s after the agent was killed"
        assert (after["layout"], after["world_size"]) == ("dp=2", 2)
        assert lost not in {p["node"] for p in after["placement"]}
        recovery = next(t for t in stack.get(f"api/transitions?job={job['id']}", token=True)["results"]
                        if t["kind"] == "restore")
        assert recovery["state"] == "committed" and recovery["verification"]["verified"] is True, recovery
        print(f"{lost}'s agent killed: the job trained on the survivors as dp=2 {seconds:.1f} s later")
    finally:
        wait_stopped(stack, job, read)
    # On real text (issue 42): across the lost node, every sample of the run read once, in order.
    assert_each_sample_read_once(read(), directory, 12, 16)


CHECKPOINT_INTERVAL = 100


def test_killing_the_old_ranks_agent_during_the_transfer_restores_the_job_from_its_checkpoint(
        stack, restarted_agents, tmp_path) -> None:
    """Issue 6's fault test, during the transfer: a job on node-1 grows onto node-2; while
    the state moves (a joining rank holds the union world there, by fault injection), node-1's
    agent is killed with the job's old ranks. The joining ranks alone no longer hold the
    state, so the resize ends aborted and the job restarts from its latest periodic
    checkpoint on node-2's GPUs (the restore row says so); the loaded state's digests equal
    the saved ones, the first steps after the restore repeat the old world's losses exactly,
    and training goes on."""
    replace_agent(stack, restarted_agents, "node-2", tmp_path / "node-2.log",
                   DYNAPLANE_FAULT="hold-in-transfer:2:30")
    # The old world switches at the first step boundary after the joining ranks are ready,
    # and a checkpoint due at that step is written first: with checkpoints every few steps
    # the switch often fell on a checkpointed step, nothing was redone and the repeated step
    # this test compares never came. So the resize is posted once the first checkpoint is
    # in, with the next one far beyond what the joining ranks' preparation takes (20-45
    # steps here): the switch comes after the checkpoint step and before the next.
    job = stack.post("api/jobs", {"name": "restore", "model": "tiny-gpt", "gpus": 2, "global_batch": 12,
                                  "seq_len": 16, "checkpoint_interval": CHECKPOINT_INTERVAL})

    def read() -> dict:
        return stack.get(f"api/jobs/{job['id']}", token=True)

    def loss() -> dict:
        return stack.get(f"api/jobs/{job['id']}/live", token=True)["metrics"].get("loss", {"x": [], "y": []})

    killed = False
    try:
        assert {p["node"] for p in job["placement"]} == {"node-1"}
        wait_for(lambda: read()["checkpoint_step"] is not None, timeout=120)
        transition = stack.post(f"api/jobs/{job['id']}/resize", {"gpus": 4})
        assert {p["node"] for p in transition["destination_placement"] if p["rank"] >= 2} == {"node-2"}
        wait_for(lambda: stack.get(f"api/transitions/{transition['id']}", token=True)["state"] == "transferring",
                 timeout=90)
        before = read()
        checkpoint, last_step = before["checkpoint_step"], before["step"]
        assert checkpoint == CHECKPOINT_INTERVAL < last_step, (
            f"the switch at step {last_step} came after a later checkpoint ({checkpoint}): the joining ranks' "
            f"preparation took over {CHECKPOINT_INTERVAL} steps")
        old_world, _ = wait_for(lambda: (m := loss())["x"].count(checkpoint + 1) == 1 and m, timeout=30)
        old_loss = old_world["y"][old_world["x"].index(checkpoint + 1)]
        os.kill(node_of(stack, "node-1")["agent_pid"], signal.SIGKILL)
        killed = True
        started = time.monotonic()
        restore, seconds = wait_for(lambda: next((t for t in stack.get(f"api/transitions?job={job['id']}", token=True)
                                                  ["results"] if t["kind"] == "restore"
                                                  and t["state"] == "committed"), None), timeout=90)
        resize = stack.get(f"api/transitions/{transition['id']}", token=True)
        assert resize["state"] == "aborted"
        assert "ranks lost while the resize was transferring: node node-1 (ranks 0, 1) lost" in resize["reason"]
        assert restore["reason"] == (f"node node-1 (ranks 0, 1) lost at step {last_step}; restored from checkpoint "
                                     f"step {checkpoint} ({last_step - checkpoint} steps redone) on 2 GPUs as dp=2; "
                                     f"the surviving ranks (0 of 2) no longer held every state element "
                                     f"(78 tensor states incomplete, e.g. llm.embed.weight param)")
        assert restore["verification"]["verified"] is True and restore["step"] == checkpoint
        assert restore["destination_placement"] == [{"rank": 0, "node": "node-2", "gpu": 0},
                                                     {"rank": 1, "node": "node-2", "gpu": 1}]
        after, _ = wait_for(lambda: (j := read())["state"] == "running" and j, timeout=60)
        assert (after["layout"], after["world_size"], after["error"]) == ("dp=2", 2, "")
        assert {p["node"] for p in after["placement"]} == {"node-2"}
        # Training goes on from the checkpoint: the record was rewound to it at the restore (issue
        # 43), and the restored world's next step, recorded in its place, has the old world's
        # loss bit for bit.
        # (the restore row committed with the rewind: what the series holds past the checkpoint now
        # is the restored world's)
        series, _ = wait_for(lambda: (m := loss())["x"].count(checkpoint + 1) == 1 and m, timeout=60)
        trained_again = time.monotonic() - started
        assert trained_again < 30, f"training again {trained_again:.1f} s after the old ranks' node was lost"
        assert sorted(series["x"]) == list(range(1, int(max(series["x"])) + 1)), series["x"]  # each step once
        assert series["y"][series["x"].index(checkpoint + 1)] == old_loss, (series, old_loss)
        seen = max(series["x"])
        wait_for(lambda: max(loss()["x"]) >= seen + 2, timeout=60)
        print(f"node-1 killed during the transfer; restored from checkpoint step {checkpoint} on node-2, "
              f"{seconds:.1f} s to the committed restore row, training again {trained_again:.1f} s after the kill")
    finally:
        wait_stopped(stack, job, read)
        if killed:
            replace_agent(stack, restarted_agents, "node-1", tmp_path / "node-1.log")
        replace_agent(stack, restarted_agents, "node-2", tmp_path / "node-2-clean.log")
    assert {g["state"] for n in ("node-1", "node-2") for g in node_of(stack, n)["gpus"]} == {"free"}


def test_agent_loss_and_return(stack, tmp_path) -> None:
    """Kill an agent: its node and GPUs are lost within 15 s; start it again: healthy."""
    os.kill(node_of(stack, "node-1")["agent_pid"], signal.SIGKILL)  # (an earlier test may have restarted it)
    killed = time.monotonic()
    node, _ = wait_for(lambda: (n := node_of(stack, "node-1"))["state"] == "lost" and n, timeout=15)
    lost_after = time.monotonic() - killed
    assert {g["state"] for g in node["gpus"]} == {"lost"}
    assert node_of(stack, "node-2")["state"] == "healthy"
    assert stack.get("api/health")["agents"] == {"healthy": 1, "lost": 1}
    print(f"node-1 lost {lost_after:.1f} s after its agent was killed")

    env = {**os.environ, **stack.agent_env("node-1")}
    agent = subprocess.Popen([sys.executable, "-m", "dynaplane", "agent", "--name", "node-1", "--gpus", "2"],
                             env=env, cwd=ROOT, stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        node, back_after = wait_for(lambda: (n := node_of(stack, "node-1"))["state"] == "healthy" and n, timeout=30)
        assert {g["state"] for g in node["gpus"]} == {"free"}
        assert node["agent_pid"] == agent.pid
        print(f"node-1 healthy again {back_after:.1f} s after its agent restarted")
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(timeout=20)


def test_run_command_on_embedded_defaults_starts_and_stops_cleanly(tmp_path) -> None:
    """No REDIS_URL, no DATABASE_URL: embedded Valkey and SQLite; Ctrl-C leaves nothing."""
    process = StackProcess(tmp_path / "var", env={"REDIS_URL": None, "DATABASE_URL": None})
    process.start()
    try:
        seconds = process.wait_ready()
        health = process.get("api/health")
        assert health["database"]["vendor"] == "sqlite"
        # the embedded broker asks a password (issue 44), kept in the var dir for its owner only
        assert health["broker"]["url"].startswith("redis://dynaplane:***@127.0.0.1:") and health["agents"]["healthy"] == 2
        assert (tmp_path / "var" / "broker_password").stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "var" / "dynaplane.sqlite3").exists()
        print(f"`dynaplane up` to healthy /api/health on embedded defaults: {seconds:.1f} s")
    finally:
        left = process.stop()
    assert left == [], f"processes left behind: {left}"
    assert process.process.returncode == 0
    assert "stopped" in process.output()
    assert not (tmp_path / "var" / "stack.json").exists()


def test_run_command_demo_job_trains_by_itself_within_a_minute(tmp_path) -> None:
    """`make run` (`dynaplane up` on embedded defaults, demo job on): the demo job is started
    by the launcher once the agents are up, and reports training steps within 60 s of the
    command starting (its dataset prepared on the way); nothing is posted to the API here."""
    process = StackProcess(tmp_path / "var", env={"REDIS_URL": None, "DATABASE_URL": None}, demo=True)
    process.start()
    try:
        ready = process.wait_ready()
        (demo,) = [j for j in process.get("api/jobs", token=True)["results"] if j["name"] == "demo"]

        def first_step() -> bool:
            live = process.get(f"api/jobs/{demo['id']}/live", token=True)
            return bool(live["metrics"].get("loss", {}).get("x"))

        wait_for(first_step, timeout=max(1.0, 60 - (time.monotonic() - process.started_at)), interval=0.25)
        training = time.monotonic() - process.started_at
        job = process.get(f"api/jobs/{demo['id']}", token=True)
        assert job["state"] == "running" and job["layout"] == "tp=2", job
        # It trains on the Python standard library's source, prepared on this first start (docs/datasets.md).
        assert job["dataset"]["name"] == "python-stdlib" and job["data_progress"]["epoch"] is not None, job
        assert "demo job started" in process.output() and "demo dataset python-stdlib" in process.output()
        # and draws its held-out loss beside the training loss (every 25 steps)
        validation, _ = wait_for(lambda: process.get(f"api/jobs/{demo['id']}/live", token=True)["metrics"]
                                 .get("validation_loss", {}).get("x"), timeout=60)
        assert validation[0] == job["eval_every"] == 25, (validation, job["eval_every"])
        print(f"`dynaplane up` (demo on, embedded defaults): healthy {ready:.1f} s, demo job's first step "
              f"{training:.1f} s after the command started")
    finally:
        left = process.stop()
    assert left == [], f"processes left behind: {left}"
    assert training < 60
