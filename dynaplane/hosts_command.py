"""`dynaplane hosts`: dynaplane across hosts on one machine, for developers (issue 44). The control
plane (`dynaplane up --host` on a bridge's address, on the embedded defaults whatever REDIS_URL and
DATABASE_URL say: SQLite and its embedded broker with a password; no agents of its own) and, on each of N test hosts (network namespaces, dynaplane/netns_hosts.py), one agent
enrolled with a token of its own (`dynaplane agent --join URL`). Ctrl-C stops it all and removes
the hosts. Needs root. The host tests and the resize benchmark across hosts start their agents
with start_agents() too."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dynaplane.netns_hosts import Hosts, available

ROOT = Path(__file__).resolve().parent.parent


def _call(url: str, token: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url.rstrip("/") + "/" + path, method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def unshared(folder: Path, argv: list[str]) -> list[str]:
    """`argv` run in a mount namespace of its own that sees an empty tmpfs at `folder`: a host that
    does not mount the shared storage there (its own disk at the same path)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mkdir -p "$0" && mount -t tmpfs dynaplane-unshared "$0" && exec "$@"', str(folder), *argv]


def start_agents(hosts: Hosts, url: str, admin_token: str, var_dir: Path, gpus_per_host: int,
                 own_checkpoints: tuple[str, ...] = (), env_of: dict[str, dict[str, str]] | None = None
                 ) -> dict[str, Path]:
    """On each host, an agent with `gpus_per_host` virtual GPUs, joined with a token the admin
    issues through the API (the token in its environment, never on its command line). The hosts
    named in `own_checkpoints` see storage of their own at the checkpoint root; `env_of[host]`:
    more of that agent's environment (its ranks inherit it). Returns each agent's log file."""
    env = {**os.environ, "DYNAPLANE_VAR_DIR": str(var_dir), "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)  # the agents learn the broker when they join
    logs = {}
    for name in hosts.names:
        token = _call(url, admin_token, "api/agent-tokens", {"node": name, "note": "a test host"})["token"]
        argv = [sys.executable, "-m", "dynaplane", "agent", "--join", url, "--gpus", str(gpus_per_host)]
        if name in own_checkpoints:
            argv = unshared(var_dir / "checkpoints", argv)
        logs[name] = var_dir / f"agent-{name}.log"
        log = open(logs[name], "wb")
        hosts.popen(name, argv, env={**env, **(env_of or {}).get(name, {}), "DYNAPLANE_AGENT_TOKEN": token}, cwd=ROOT,
                    stdout=log, stderr=log)
    return logs


def wait_healthy(url: str, admin_token: str, names: list[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            nodes = _call(url, admin_token, f"api/nodes?limit={max(200, len(names))}")["results"]
        except (OSError, urllib.error.URLError, ValueError):
            nodes = []
        healthy = {n["name"] for n in nodes if n["state"] == "healthy"}
        if set(names) <= healthy:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"agents not healthy after {timeout:.0f} s: {sorted(set(names) - healthy)}")
        time.sleep(0.5)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hosts", help="developers: the control plane and agents on N test hosts of this machine "
                                     "(network namespaces; root)")
    p.add_argument("--hosts", type=int, default=3, help="agent hosts (default 3)")
    p.add_argument("--gpus-per-host", type=int, default=2, help="virtual GPUs of each host's agent (default 2)")
    p.add_argument("--port", type=int, default=8000, help="the web server's port on the bridge (default 8000)")
    p.add_argument("--var-dir", default=None, help="the control plane's state (default ./var/hosts)")
    p.add_argument("--own-checkpoints", default="", metavar="HOST,...",
                   help="hosts that see storage of their own at the checkpoint root (to watch a pre-flight fail)")
    p.set_defaults(func=run)


def _wait_for_stack(process: subprocess.Popen, state_file: Path, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"dynaplane up exited ({process.returncode})")
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("launcher_pid") == process.pid and state.get("token"):
            return state
        time.sleep(0.3)
    raise TimeoutError(f"dynaplane up not ready after {timeout:.0f} s")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    why = available()
    if why is not None:
        print(f"dynaplane hosts: no test hosts here: {why}", file=sys.stderr)
        return 2
    if not 1 <= args.hosts <= 200 or not 1 <= args.gpus_per_host <= 64:
        print("dynaplane hosts: --hosts is 1 to 200, --gpus-per-host 1 to 64", file=sys.stderr)
        return 2
    names = [f"host-{i}" for i in range(1, args.hosts + 1)]
    own = tuple(n for n in args.own_checkpoints.split(",") if n)
    if set(own) - set(names):
        print(f"dynaplane hosts: --own-checkpoints names no host of {names}: {sorted(set(own) - set(names))}",
              file=sys.stderr)
        return 2
    var_dir = Path(args.var_dir or "var/hosts").resolve()
    var_dir.mkdir(parents=True, exist_ok=True)
    hosts = Hosts(names)
    stack = None
    signal.signal(signal.SIGINT, _interrupt)  # (a shell starts background jobs with SIGINT ignored)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        print(f"hosts: {', '.join(f'{n} {hosts.address(n)}' for n in names)} on the bridge {hosts.gateway}", flush=True)
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}  # (ours: embedded)
        stack = subprocess.Popen([sys.executable, "-m", "dynaplane", "up", "--host", hosts.gateway, "--port",
                                  str(args.port), "--agents", "0", "--no-demo", "--var-dir", str(var_dir)],
                                 cwd=ROOT, env=env, start_new_session=True)
        state = _wait_for_stack(stack, var_dir / "stack.json")
        start_agents(hosts, state["url"], state["token"], var_dir, args.gpus_per_host, own)
        wait_healthy(state["url"], state["token"], names)
        print(f"\nready: {state['url']}  login {state['username']} / {state['password']}  API token {state['token']}\n"
              f"agents' logs: {var_dir}/agent-host-N.log\n"
              + "".join(f"cut {n}'s link: ip link set {hosts.outside(n)} down   (mend: ... up)   "
                        f"a shell there: ip netns exec {hosts.namespace(n)} bash\n" for n in names)
              + "Ctrl-C stops everything and removes the hosts.", flush=True)
        while stack.poll() is None:
            time.sleep(0.5)
        print(f"dynaplane hosts: dynaplane up exited ({stack.returncode})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"dynaplane hosts: {exc}", file=sys.stderr)
        return 1
    finally:
        if stack is not None and stack.poll() is None:
            os.killpg(stack.pid, signal.SIGINT)
            try:
                stack.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(stack.pid, signal.SIGKILL)
        hosts.close()
