"""A control plane and agents on test hosts (issue 44), for the host tests and the resize
benchmark across hosts: `dynaplane up --host` on the bridge's address with its embedded broker
(a password) and no agents of its own; on each host one agent, enrolled with a token an admin
issued through the API (`dynaplane agent --join URL`, the token in its environment)."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

from dynaplane.hosts_command import start_agents, wait_healthy
from dynaplane.netns_hosts import Hosts
from tests.support.stack import StackProcess


@contextmanager
def host_cluster(var_dir: Path, names: list[str], gpus_per_host: int = 2, ready_timeout: float = 120,
                 own_checkpoints: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 agent_env: dict[str, dict[str, str]] | None = None):
    """(stack, hosts) with one healthy agent of `gpus_per_host` virtual GPUs on each host; the
    hosts named in `own_checkpoints` see storage of their own at the checkpoint root (unshared);
    `env`: the control plane's settings; `agent_env[host]`: that host's agent's."""
    hosts = Hosts(names)
    stack = StackProcess(var_dir, agents=0, gpus_per_agent=gpus_per_host,
                         env={"DATABASE_URL": None, "REDIS_URL": None, **(env or {})})
    stack.argv += ["--host", hosts.gateway]
    try:
        stack.start()
        stack.wait_ready(timeout=ready_timeout)
        start_agents(hosts, stack.url, stack.state["token"], stack.var_dir, gpus_per_host, own_checkpoints,
                     agent_env)
        wait_healthy(stack.url, stack.state["token"], names)
        yield stack, hosts
    finally:
        if stack.process is not None:
            stack.stop()
        hosts.close()


SINK = r"""
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(1)
print("READY", flush=True)
conn, _ = server.accept()
total = 0
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    total += len(chunk)
print(total, flush=True)
"""

SOURCE = r"""
import socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
block, sent, start = b"\0" * (1 << 20), 0, time.perf_counter()
while time.perf_counter() - start < float(sys.argv[3]):
    sock.sendall(block)
    sent += len(block)
sock.close()
print(sent, time.perf_counter() - start, flush=True)
"""


def link_bandwidth(hosts: Hosts, source: str, sink: str, seconds: float = 2.0, port: int = 29399) -> float:
    """Bytes per second one TCP stream moves from host `source` to host `sink` (over their veth
    pairs and the bridge), as the ranks' gloo traffic crosses them."""
    import subprocess

    receiver = hosts.popen(sink, [sys.executable, "-c", SINK, hosts.address(sink), str(port)],
                           stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "READY"
    started = time.monotonic()
    sent = hosts.run(source, [sys.executable, "-c", SOURCE, hosts.address(sink), str(port), str(seconds)],
                     timeout=seconds + 30)
    if sent.returncode != 0:
        raise RuntimeError(f"bandwidth probe failed: {sent.stderr[-2000:]}")
    received = int(receiver.stdout.readline())
    receiver.wait(timeout=10)
    total, wall = sent.stdout.split()
    assert received == int(total), (received, total, time.monotonic() - started)
    return received / float(wall)
