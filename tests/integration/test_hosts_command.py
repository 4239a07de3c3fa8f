"""`dynaplane hosts` (issue 44): a developer's cluster of test hosts on one machine. It comes up
with each host's agent enrolled and healthy at the host's own address, says how to reach and cut
each host, and Ctrl-C removes everything it made."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dynaplane.netns_hosts import NETNS_ETC, PREFIX, available
from tests.support.stack import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.hosts, pytest.mark.timeout(240),
              pytest.mark.skipif(available() is not None, reason=f"no test hosts here: {available()}")]


def _namespaces(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{PREFIX}{pid}-")]


def test_hosts_command_brings_up_enrolled_agents_and_ctrl_c_removes_the_hosts(tmp_path) -> None:
    command = subprocess.Popen([sys.executable, "-u", "-m", "dynaplane", "hosts", "--hosts", "2", "--gpus-per-host",
                                "1", "--port", "0", "--var-dir", str(tmp_path / "var")], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("Ctrl-C stops everything and removes the hosts") for line in lines):
            assert time.monotonic() < deadline and command.poll() is None, "".join(lines)[-3000:]
            lines.append(command.stdout.readline())
        text = "".join(lines)
        addresses = dict(re.findall(r"(host-\d) (10\.77\.\d+\.\d+)", text.splitlines()[0]))
        url, token = re.search(r"^ready: (\S+) .*API token (\w+)$", text, re.M).groups()
        assert set(addresses) == {"host-1", "host-2"} and len(_namespaces(command.pid)) == 2, text
        for name in addresses:
            assert f"ip netns exec {PREFIX}{command.pid}-{name} bash" in text, text
        request = urllib.request.Request(url + "api/nodes", headers={"Authorization": f"Token {token}"})
        nodes = json.loads(urllib.request.urlopen(request, timeout=10).read())["results"]
        assert {(n["name"], n["host"], n["state"], len(n["gpus"])) for n in nodes} == {
            (name, address, "healthy", 1) for name, address in addresses.items()}, nodes
    finally:
        command.send_signal(signal.SIGINT)
        rest, _ = command.communicate(timeout=90)
    assert command.returncode == 0, rest[-3000:]
    assert _namespaces(command.pid) == [] and not list(NETNS_ETC.glob(f"{PREFIX}{command.pid}-*"))
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert [pid for pid in left if int(pid) != os.getpid()] == [], left
    assert not (Path(tmp_path / "var") / "stack.json").exists()
