"""Test hosts on this machine (issue 44; the host tests and `dynaplane hosts`): each a Linux network namespace with an address of its
own on a bridge in the root namespace, which holds the control plane. A process run in a host
reaches the others, and the control plane, only over that network; cutting a host's link is
`ip link set ... down` on its end of the veth pair.

Every name carries the creating process's pid (`dp<pid>-...`): `sweep_stale()` deletes what a
killed test run left behind (namespaces, bridge, and the processes still in them), and `close()`
what this one made. Needs root (CI and the development machine run as root)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "dp"
# `ip netns exec NS` mounts /etc/netns/NS/* over /etc/*: each host's own resolver settings. The
# hosts' network has no name server; the machine's one is out of their reach, so without this
# every lookup waited for its timeout (c10d's store looks up each client's name: 10 s per
# rendezvous). With a name server on the host's own loopback, where none listens, a lookup fails
# at once, as on an isolated cluster network.
NETNS_ETC = Path("/etc/netns")
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """Why hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in map(int, pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", name, check=False)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Delete the namespaces and bridges of test runs whose process is gone; returns their names."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        owner = name[len(PREFIX):].split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not _alive(int(owner)):
            _kill_namespace(name)
            gone.append(name)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        owner = name[len(PREFIX) + 2:]  # dpbr<pid>
        if name.startswith(f"{PREFIX}br") and owner.isdigit() and not _alive(int(owner)):
            _ip("link", "del", name, check=False)
            gone.append(name)
    for folder in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else ():
        owner = folder.name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)
    return gone


class Hosts:
    """`names` hosts on 10.77.<n>.0/24: the bridge (the control plane's side) is .1, host k is .k+2."""

    def __init__(self, names: list[str]) -> None:
        sweep_stale()
        self.tag = str(os.getpid())
        self.subnet = f"10.77.{os.getpid() % 250}"
        self.bridge = f"{PREFIX}br{self.tag}"
        self.gateway = f"{self.subnet}.1"
        self.names = list(names)
        self.processes: list[subprocess.Popen] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for k, name in enumerate(self.names):
                self._add(k, name)
        except BaseException:
            self.close()
            raise

    def namespace(self, name: str) -> str:
        return f"{PREFIX}{self.tag}-{name}"

    def interface(self, name: str) -> str:
        """The host's end of its link, as the host itself names it."""
        return f"eth-{name}"[:15]

    def outside(self, name: str) -> str:
        """The root namespace's end of the host's link (on the bridge): down is a cut cable."""
        return f"v{self.tag}{self.names.index(name)}"[:15]

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 2}"

    def _add(self, k: int, name: str) -> None:
        ns, inside, outside = self.namespace(name), self.interface(name), self.outside(name)
        _ip("netns", "add", ns)
        (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / ns / "resolv.conf").write_text(RESOLV_CONF)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)

    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on host `name` (its own process group, so close() can end it all)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.namespace(name), *argv], start_new_session=True,
                                   **kwargs)
        self.processes.append(process)
        return process

    def run(self, name: str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace(name), *argv], capture_output=True, text=True,
                              timeout=timeout)

    def cut(self, name: str) -> None:
        """The host's link goes down (its cable pulled): nothing reaches it or leaves it."""
        _ip("link", "set", self.outside(name), "down")

    def mend(self, name: str) -> None:
        _ip("link", "set", self.outside(name), "up")

    def close(self) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for name in self.names:
            # the pair first, at once: a namespace is deleted lazily, and with it its veth, whose name
            # the next Hosts of this process would take
            _ip("link", "del", self.outside(name), check=False)
            _kill_namespace(self.namespace(name))
        _ip("link", "del", self.bridge, check=False)
        deadline = time.monotonic() + 5
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"process {process.pid} outlived its host", file=sys.stderr)
