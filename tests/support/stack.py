"""Run `dynaplane up` as a real subprocess for a test, on its own database and var dir."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


ROOT = Path(__file__).resolve().parents[2]


def empty_redis_db(url: str, db: int) -> str:
    """`url` on Redis database `db`, emptied first. A stack under test gets a database number
    of its own, so its queues never mix with another stack's; emptying it drops what an
    earlier run left there (a killed run's undelivered orders and reports, which would reach
    this run's jobs: a fresh SQL database numbers its jobs from 1 again). tests/services_plugin.py
    makes one test run at a time use the machine's Redis, so nobody else is using it."""
    import redis

    separate = urlunsplit(urlsplit(url)._replace(path=f"/{db}"))
    redis.Redis.from_url(separate).flushdb()
    return separate


@contextmanager
def isolated_database():
    """A DATABASE_URL for a stack under test: a fresh PostgreSQL database when the tests
    run on PostgreSQL (dropped afterwards), else None (the stack's SQLite in its var dir)."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        yield None
        return
    import psycopg

    name = f"dynaplane_it_{uuid.uuid4().hex[:10]}"
    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class StackProcess:
    """`dynaplane up --port 0` in a temporary var dir; `state` is its var/stack.json."""

    def __init__(self, var_dir: Path, *, agents: int = 2, gpus_per_agent: int = 2, env: dict[str, str | None],
                 restart_agents: bool = False, demo: bool = False, tls: tuple[Path, Path] | None = None,
                 workers: int = 1, web: int = 1) -> None:
        self.var_dir = var_dir
        self.tls = tls  # (certificate, key): the web server speaks HTTPS, the calls here trust that certificate
        self.env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        self.env["PYTHONUNBUFFERED"] = "1"
        self.argv = [sys.executable, "-m", "dynaplane", "up", "--port", "0", "--var-dir", str(var_dir),
                     "--agents", str(agents), "--gpus-per-agent", str(gpus_per_agent),
                     *([] if demo else ["--no-demo"]), *([] if restart_agents else ["--no-agent-restart"]),
                     *(["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])] if tls else []),
                     *(["--workers", str(workers)] if workers != 1 else []),
                     *(["--web", str(web)] if web != 1 else [])]
        self.process: subprocess.Popen | None = None
        self.state: dict = {}
        self.output_path = var_dir / "launcher.out"
        self.started_at = 0.0

    def start(self) -> None:
        self.var_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=open(self.output_path, "wb"),
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 90.0) -> float:
        """Seconds from start until /api/health answered ok with every agent live."""
        deadline = time.monotonic() + timeout
        state_file = self.var_dir / "stack.json"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"dynaplane up exited {self.process.returncode}:\n{self.output()}")
            if state_file.exists():
                try:
                    self.state = json.loads(state_file.read_text())
                except ValueError:
                    time.sleep(0.1)
                    continue
                if self.state.get("launcher_pid") != self.process.pid:  # a killed stack's file, not yet replaced
                    time.sleep(0.1)
                    continue
                health = self.get("api/health")
                if health.get("database", {}).get("ok") and health.get("broker", {}).get("ok"):
                    return time.monotonic() - self.started_at
            time.sleep(0.1)
        raise AssertionError(f"stack not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    @property
    def url(self) -> str:
        return self.state["url"]

    def get(self, path: str, token: bool | None = None) -> dict:
        """GET the API; with the token when asked, and by default on a stack other hosts reach
        (`--host`: reads need signing in there)."""
        request = urllib.request.Request(self.url + path)
        if token is None:
            token = "--host" in self.argv and "token" in self.state
        if token:
            request.add_header("Authorization", f"Token {self.state['token']}")
        with urllib.request.urlopen(request, timeout=5, context=self._trust()) as response:
            return json.loads(response.read())

    def _trust(self):
        import ssl

        return ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else None

    def post(self, path: str, body: dict, method: str = "POST") -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method=method,
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Token {self.state['token']}"})
        with urllib.request.urlopen(request, timeout=5, context=self._trust()) as response:
            return json.loads(response.read())

    def agent_env(self, name: str) -> dict[str, str]:
        """What an agent `name` started beside the stack needs in its environment: the broker and
        its token (the launcher's for its own agents, else one issued through the API now)."""
        tokens = self.state.setdefault("agent_tokens", {})
        if name not in tokens:
            tokens[name] = self.post("api/agent-tokens", {"node": name})["token"]
        return {"REDIS_URL": self.state["redis_url"], "DYNAPLANE_AGENT_TOKEN": tokens[name]}

    def child_pids(self) -> dict[str, int]:
        return dict(self.state.get("pids", {}))

    def kill(self) -> None:
        """SIGKILL the launcher and every process it started, at once (the stack's host
        losing them all); their rank processes get their parent-death signal."""
        if self.process is None:
            return
        for group in [self.process.pid, *self.child_pids().values()]:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait(timeout=10)

    def stop(self, timeout: float = 30.0) -> list[int]:
        """Ctrl-C the launcher; return the pids still alive in any child's process group."""
        if self.process is None:
            return []
        groups = [self.process.pid, *self.child_pids().values()]
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        left = sorted({pid for group in groups for pid in group_members(group)})
        for group in groups:  # never leak processes into the next test, even on failure
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return left


@contextmanager
def stack_of_its_own(var_dir: Path, redis_db: int, *, env: dict[str, str] | None = None, timeout: float = 120.0,
                     **options):
    """A started, healthy StackProcess on a database of its own and, when the tests run on the
    machine's Redis, database `redis_db` of it (else its embedded Valkey); stopped afterwards.
    `.database_url` is its database (None: its SQLite)."""
    redis = {"REDIS_URL": empty_redis_db(os.environ["REDIS_URL"], redis_db)} if os.environ.get("REDIS_URL") else {}
    with isolated_database() as database_url:
        stack = StackProcess(var_dir, env={"DATABASE_URL": database_url, **redis, **(env or {})}, **options)
        stack.database_url = database_url
        stack.start()
        try:
            stack.wait_ready(timeout=timeout)
            yield stack
        finally:
            stack.stop()


def wait_for(predicate, timeout: float, interval: float = 0.1):
    """Poll until predicate() is truthy; return (value, seconds waited)."""
    start = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def wait_for_transition_end(stack, transition_id: int, timeout: float = 150):
    """Poll a transition until it is committed, aborted or rolled back; (row, seconds)."""
    return wait_for(lambda: (t := stack.get(f"api/transitions/{transition_id}", token=True))["state"] in (
        "committed", "aborted", "rolled_back") and t, timeout=timeout)


def _alive(pid: int) -> bool:
    """A live (not zombie) process: a killed agent may linger unreaped for a moment."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return fields[0] != "Z"


class SharedStack(StackProcess):
    """One stack for every test module that needs one (`dynaplane up` takes 10-60 s on the CI
    machine). Tests kill agents; before each test `ready_for_test` starts again, as the
    launcher's agent would be, every agent that is gone, and waits until every node is
    healthy and every GPU free: each test starts on the stack a fresh one would give it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.agents = int(self.argv[self.argv.index("--agents") + 1])
        self.gpus_per_agent = int(self.argv[self.argv.index("--gpus-per-agent") + 1])
        self.restarted: list[subprocess.Popen] = []

    def _start_agent(self, name: str) -> subprocess.Popen:
        env = {**self.env, **self.agent_env(name), "DYNAPLANE_VAR_DIR": str(self.var_dir)}
        log = open(self.var_dir / "logs" / f"agent-{name}.restarted.log", "ab")
        agent = subprocess.Popen([sys.executable, "-m", "dynaplane", "agent", "--name", name,
                                  "--gpus", str(self.gpus_per_agent)], env=env, cwd=ROOT, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.restarted.append(agent)
        return agent

    def ready_for_test(self, timeout: float = 90.0) -> None:
        started = {}
        for i in range(1, self.agents + 1):
            name = f"node-{i}"
            node = self.get(f"api/nodes/{name}")
            if node["state"] != "healthy" or not node["agent_pid"] or not _alive(node["agent_pid"]):
                started[name] = self._start_agent(name).pid
                self.state["pids"][f"agent-{name}"] = started[name]  # child_pids(): the agents running now

        def ready() -> bool:
            nodes = {n["name"]: n for n in self.get("api/nodes")["results"]}
            health = self.get("api/health")
            return (all(nodes[name]["agent_pid"] == pid for name, pid in started.items())
                    and health["agents"] == {"healthy": self.agents, "lost": 0}
                    and health["gpus"]["free"] == health["gpus"]["total"] == self.agents * self.gpus_per_agent)

        wait_for(ready, timeout=timeout, interval=0.2)

    def stop(self, timeout: float = 30.0) -> list[int]:
        for agent in self.restarted:
            try:
                os.killpg(agent.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for agent in self.restarted:
            try:
                agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
        return super().stop(timeout)


def group_members(pgid: int) -> list[int]:
    """Live processes in a process group (Linux /proc), to prove nothing was left."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members
