"""The whole stack as separate processes: web, control worker + beat, agents, Redis."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from websockets.sync.client import connect

from controlplane.cluster.events import cluster_event_adapter
from tests.support.stack import ROOT, StackProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _node(stack, name: str) -> dict:
    return stack.get(f"api/nodes/{name}")


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
        created = stack.post("api/jobs", {"name": "ws-job", "model": "tiny-gpt", "layout": "tp=2,dp=2"})
        event = cluster_event_adapter.validate_python(json.loads(socket.recv(timeout=10)))
        assert (event.type, event.op, event.job.id, event.job.gpus) == ("job", "upsert", created["id"], 4)
        assert event.seq > hello.seq


def test_agent_loss_and_return(stack, tmp_path) -> None:
    """Kill an agent: its node and GPUs are lost within 15 s; start it again: healthy."""
    os.kill(stack.child_pids()["agent-node-1"], signal.SIGKILL)
    killed = time.monotonic()
    node, _ = wait_for(lambda: (n := _node(stack, "node-1"))["state"] == "lost" and n, timeout=15)
    lost_after = time.monotonic() - killed
    assert {g["state"] for g in node["gpus"]} == {"lost"}
    assert _node(stack, "node-2")["state"] == "healthy"
    assert stack.get("api/health")["agents"] == {"healthy": 1, "lost": 1}
    print(f"node-1 lost {lost_after:.1f} s after its agent was killed")

    env = {**os.environ, "REDIS_URL": stack.state["redis_url"]}
    agent = subprocess.Popen([sys.executable, "-m", "dynaplane", "agent", "--name", "node-1", "--gpus", "2"],
                             env=env, cwd=ROOT, stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        node, back_after = wait_for(lambda: (n := _node(stack, "node-1"))["state"] == "healthy" and n, timeout=30)
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
        assert health["broker"]["url"].startswith("redis://127.0.0.1:") and health["agents"]["healthy"] == 2
        assert (tmp_path / "var" / "dynaplane.sqlite3").exists()
        print(f"`dynaplane up` to healthy /api/health on embedded defaults: {seconds:.1f} s")
    finally:
        left = process.stop()
    assert left == [], f"processes left behind: {left}"
    assert process.process.returncode == 0
    assert "stopped" in process.output()
    assert not (tmp_path / "var" / "stack.json").exists()
