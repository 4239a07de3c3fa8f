"""`dynaplane up`: the whole stack on one machine, embedded defaults when nothing is set.

Order: var dir -> broker (embedded Valkey unless REDIS_URL) -> database migrations and
bootstrap (admin user, API token, demo job and its dataset: the Python standard library's
source, prepared once under the data root) -> web (daphne, ASGI) -> control-plane worker
(Celery + beat) -> agents -> the demo job started (POST /api/jobs/{id}/start, when it is
pending; `--no-demo`: no demo job). Ctrl-C stops agents, then worker and web, then the broker.

Once the stack is up the launcher supervises it: a web, worker or agent process that exits
is started again (after 1, 2, 4 ... 30 s while it keeps exiting), and the stack stays up.
The embedded broker is started again too, on the same address (every process holds it and
reconnects; ranks keep their reports meanwhile: agents/runtime/outbox.py); what it held is lost,
as with any Redis restarted without persistence. `--no-agent-restart` leaves dead agents dead
(their nodes are then marked lost).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from agents import protocol
from agents.broker_urls import redacted
from agents.processes import Child, stop_in_tiers

READY_TIMEOUT_SECONDS = 90.0
DEMO_START_SECONDS = 60.0  # a 409 (its GPUs not registered yet) is retried this long
RESTART_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_SECONDS = 60.0  # a process that ran this long starts its backoff from the beginning again
# Threads of a control worker process. They share one interpreter, so they add no compute; what
# they add is report batches held at the same time, which one of them applies together in one
# transaction (controlplane/common/combining.py): the more threads wait, the bigger the groups.
WORKER_THREADS = 8


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def tls_files(cert: str | None, key: str | None) -> tuple[Path, Path] | None:
    """--tls-cert and --tls-key: both or neither, readable PEM files whose key fits the
    certificate (checked here, not by the web server failing later); ValueError says which."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("give both --tls-cert and --tls-key (a certificate and its private key), or neither")
    paths = Path(cert).resolve(), Path(key).resolve()
    for option, path in zip(("--tls-cert", "--tls-key"), paths):
        if not path.is_file():
            raise ValueError(f"{option} {path} does not exist")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(str(paths[0]), str(paths[1]))
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its private key "
                         f"({exc})") from None
    return paths


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class StackOptions:
    host: str
    port: int
    agents: int
    gpus_per_agent: int
    var_dir: Path
    demo: bool
    verbose: bool
    restart_agents: bool = True
    tls: tuple[Path, Path] | None = None  # (certificate chain, private key): the web server speaks HTTPS
    workers: int = 1  # control-plane worker processes (the first also runs beat)
    web: int = 1  # web server processes on the one port (a listening socket they share)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StackOptions:
        if not 0 <= args.agents <= 64:
            raise ValueError(f"--agents {args.agents}: give 0 to 64 agents")
        if not 1 <= args.gpus_per_agent <= 64:
            raise ValueError(f"--gpus-per-agent {args.gpus_per_agent}: give 1 to 64 virtual GPUs")
        port = args.port
        if port == 0:
            port = free_port(args.host)
        elif not 1 <= port <= 65535:
            raise ValueError(f"--port {port} is not a TCP port")
        elif not _port_free(args.host, port):
            raise ValueError(f"port {port} on {args.host} is in use; pass --port N (or --port 0 for any free port)")
        workers = getattr(args, "workers", 1)
        if not 1 <= workers <= 32:
            raise ValueError(f"--workers {workers}: give 1 to 32 control-plane worker processes")
        tls = tls_files(getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
        web = getattr(args, "web", 1)
        if not 1 <= web <= 32:
            raise ValueError(f"--web {web}: give 1 to 32 web server processes")
        if web > 1 and tls:
            raise ValueError(f"--web {web} with --tls-cert: one web process serves TLS; for more, put them behind "
                             "a TLS-terminating proxy and leave --tls-cert out")
        var_dir = Path(args.var_dir or os.environ.get("DYNAPLANE_VAR_DIR") or "var").resolve()
        return cls(args.host, port, args.agents, args.gpus_per_agent, var_dir, not args.no_demo, args.verbose,
                   not getattr(args, "no_agent_restart", False), tls, workers, web)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}/"

    def ssl_context(self) -> ssl.SSLContext | None:
        """What the launcher's own calls to its web server trust: the certificate it serves
        (self-signed ones included). None without TLS."""
        return ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else None

    def web_argv(self, shared_fd: int | None = None) -> list[str]:
        """daphne on the address and port: plain HTTP, or TLS through Twisted's endpoint string;
        with `shared_fd`, on the listening socket the launcher opened for several processes.
        A websocket may take 30 s to be accepted (daphne's default, 5 s, closed most of 200 pages
        that opened at once on a busy machine: benchmarks/cluster_scale.py)."""
        patience = ["--websocket_connect_timeout", "30"]
        if shared_fd is not None:
            return ["--fd", str(shared_fd), *patience]
        if not self.tls:
            return ["-b", self.host, "-p", str(self.port), *patience]
        host, cert, key = (str(part).replace(":", "\\:") for part in (self.host, *self.tls))  # (the syntax's escape)
        return ["-e", f"ssl:{self.port}:interface={host}:privateKey={key}:certKey={cert}", *patience]

    @property
    def local_only(self) -> bool:
        """Listening on loopback only: no other host can reach this stack."""
        return self.host in LOOPBACK

    @property
    def broker_bind(self) -> list[str]:
        if self.local_only:
            return ["127.0.0.1"]
        return ["0.0.0.0"] if self.host in WILDCARD else ["127.0.0.1", self.host]


LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::")


def broker_password_file(var_dir: Path) -> Path:
    """The embedded broker's password (issue 44), generated once and kept in the var dir (0600)."""
    path = var_dir / "broker_password"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(24))
    return path


class StackError(RuntimeError):
    """The stack could not start; the message says which part and where its log is."""


class Stack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.logs = options.var_dir / "logs"
        self.env = dict(os.environ)
        if options.host not in (*LOOPBACK, *WILDCARD):
            # the web server answers for the address it listens on (else every request is a 400)
            allowed = self.env.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver").split(",")
            self.env["DJANGO_ALLOWED_HOSTS"] = ",".join(dict.fromkeys([*allowed, options.host]))
        if not options.local_only:  # other hosts reach it: nothing is read without signing in (issue 44)
            self.env.setdefault("DYNAPLANE_OPEN_READS", "0")
        if options.tls:  # its session and CSRF cookies travel over HTTPS only
            self.env["DYNAPLANE_HTTPS"] = "1"
        self.env.update(
            DYNAPLANE_VAR_DIR=str(options.var_dir),
            DJANGO_SETTINGS_MODULE="controlplane.settings",
            PYTHONUNBUFFERED="1",
        )
        self.broker: list[Child] = []
        self.services: list[Child] = []
        self.agents: list[Child] = []
        self.credentials: dict = {}
        self._listener: socket.socket | None = None  # the web port, when several web processes share it
        self.started = time.monotonic()
        self.restarts: dict[str, dict] = {}  # child name -> {count, due, since}
        self.demo_deadline: float | None = None  # while the demo job waits to be started

    # --- output --------------------------------------------------------------------
    def say(self, message: str) -> None:
        print(f"dynaplane [{time.monotonic() - self.started:5.1f}s] {message}", flush=True)

    def _shared_listener(self) -> socket.socket:
        """The web port's listening socket, opened here and inherited by every web process (kept
        open by the launcher, so a web process restarted takes it up again)."""
        if self._listener is None:
            family = socket.AF_INET6 if ":" in self.options.host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.options.host, self.options.port))
            listener.listen(1024)
            listener.set_inheritable(True)
            self._listener = listener
        return self._listener

    def _child(self, name: str, argv: list[str], critical: bool, own_env: dict[str, str] | None = None,
               pass_fds: tuple[int, ...] = ()) -> Child:
        child = Child(name, argv, self.logs / f"{name}.log", critical, own_env=dict(own_env or {}),
                      pass_fds=pass_fds)
        child.start(self.env, stdout=None if not self.options.verbose else sys.stdout.buffer)
        return child

    # --- steps ---------------------------------------------------------------------
    def start_broker(self) -> None:
        if self.env.get("REDIS_URL"):
            self.say(f"broker: {redacted(self.env['REDIS_URL'])} (from REDIS_URL)")
            self._agent_broker_url(self.env["REDIS_URL"])
            return
        child = Child(
            "valkey",
            [sys.executable, "-m", "dynaplane.embedded_valkey", "--data-dir", str(self.options.var_dir / "valkey"),
             "--password-file", str(broker_password_file(self.options.var_dir)), "--bind", " ".join(self.options.broker_bind)],
            self.logs / "valkey.log",
            critical=True,
        )
        self.broker.append(child)
        url = self._broker_ready(child)
        if url is None:
            raise StackError(f"embedded Valkey did not start; see {child.log_path}:\n{child.log_tail()}")
        self.env["REDIS_URL"] = url
        child.argv += ["--port", url.rsplit(":", 1)[1].split("/")[0]]  # a restart keeps the address
        self._agent_broker_url(url)
        self.say(f"broker: embedded Valkey at {redacted(url)}, password in {broker_password_file(self.options.var_dir)}")

    def _agent_broker_url(self, url: str) -> None:
        """The broker address agents that join are given: as the control plane reaches it, but
        on the address other hosts reach (--host) when it listens on loopback here."""
        if "DYNAPLANE_AGENT_BROKER_URL" in self.env:
            return
        parts = urlsplit(url)
        if self.options.host not in (*LOOPBACK, *WILDCARD) and parts.hostname in ("127.0.0.1", "localhost"):
            netloc = parts.netloc.rsplit("@", 1)
            host = f"{self.options.host}:{parts.port}" if parts.port else self.options.host
            url = urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))
        self.env["DYNAPLANE_AGENT_BROKER_URL"] = url

    def _broker_ready(self, child: Child) -> str | None:
        """Start the embedded broker; its URL once it says READY, None when it exits instead."""
        child.start(self.env, stdout=subprocess.PIPE)
        line = child.process.stdout.readline().decode().strip()
        return line.split(" ", 1)[1] if line.startswith("READY ") else None

    def manage(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "django", *args], env=self.env, capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise StackError(f"`django-admin {' '.join(args)}` failed:\n{result.stderr.strip()[-3000:]}")
        return result.stdout

    def setup_database(self) -> None:
        self.manage("migrate", "--noinput")
        out = self.manage("dynaplane_bootstrap", "--agents", str(self.options.agents),
                          *(["--demo"] if self.options.demo else []))
        self.credentials = json.loads(out.strip().splitlines()[-1])
        self.say(f"database: {self.credentials['database']} migrated")
        dataset = self.credentials.get("dataset") or {}
        if dataset.get("error"):
            self.say(f"demo dataset not prepared ({dataset['error']}); the demo job trains on synthetic tokens")
        elif dataset.get("prepared_seconds") is not None:
            self.say(f"demo dataset {dataset['name']}: the Python standard library's source, {dataset['documents']:,} "
                     f"files ({dataset['tokens']:,} byte tokens), prepared in {dataset['prepared_seconds']:.1f} s "
                     f"(once: reused from now on)")

    def start_services(self) -> None:
        o = self.options
        shared = self._shared_listener() if o.web > 1 else None
        for n in range(1, o.web + 1):  # (several: each accepts on the one socket; the kernel shares the connections)
            argv = [sys.executable, "-m", "daphne", *o.web_argv(shared.fileno() if shared else None),
                    "controlplane.asgi:application"]
            self.services.append(self._child("web" if n == 1 else f"web-{n}", argv, critical=True,
                                             pass_fds=(shared.fileno(),) if shared else ()))
        for n in range(1, o.workers + 1):  # (scale-out: each a process of its own, the first also runs beat)
            name = "worker" if n == 1 else f"worker-{n}"
            beat = ["--beat", "--schedule", str(o.var_dir / "celerybeat-schedule")] if n == 1 else []
            self.services.append(
                self._child(name, [sys.executable, "-m", "celery", "-A", "controlplane", "worker", *beat,
                                   "--queues", ",".join((*protocol.CONTROL_QUEUES, "exports")),
                                   "--hostname", f"{name}@{socket.gethostname()}",
                                   "--pool", "threads", "--concurrency", str(WORKER_THREADS), "--loglevel", "INFO",
                                   "--without-mingle", "--without-gossip"], critical=True)
            )
        tokens = self.credentials.get("agent_tokens", {})
        for i in range(1, o.agents + 1):  # (each with its token in its environment: not on a command line)
            self.agents.append(
                self._child(f"agent-node-{i}", [sys.executable, "-m", "dynaplane", "agent", "--name", f"node-{i}",
                                               "--gpus", str(o.gpus_per_agent)], critical=False,
                            own_env={"DYNAPLANE_AGENT_TOKEN": tokens[f"node-{i}"]})
            )

    def health(self) -> dict | None:
        try:
            request = urllib.request.Request(self.options.url + "api/health")
            if self.credentials.get("token"):  # (with closed reads only a signed-in caller gets the counts)
                request.add_header("Authorization", f"Token {self.credentials['token']}")
            with urllib.request.urlopen(request, timeout=2, context=self.options.ssl_context()) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_ready(self) -> dict:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        health = None
        while time.monotonic() < deadline:
            self.check_children()
            health = self.health()
            # (a node of an earlier run may still be lost: "degraded" with every service up is ready)
            if health and health["database"]["ok"] and health["broker"]["ok"] \
                    and health["agents"]["healthy"] >= self.options.agents:
                return health
            time.sleep(0.25)
        raise StackError(f"not healthy after {READY_TIMEOUT_SECONDS:.0f} s; last /api/health: {health}; logs in {self.logs}")

    def _api_post(self, path: str) -> tuple[int, dict]:
        request = urllib.request.Request(self.options.url + path, data=b"{}", method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Token {self.credentials['token']}"})
        try:
            with urllib.request.urlopen(request, timeout=5, context=self.options.ssl_context()) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read())
            except ValueError:
                return exc.code, {}

    def start_demo(self) -> None:
        """Start the demo job when it is pending (a later `up` finds it as it was left: a
        stopped demo stays stopped). 409 while the agents' GPUs are not all registered: tried
        again on the next supervision tick, until DEMO_START_SECONDS."""
        demo = self.credentials.get("demo")
        if not demo or demo.get("state") != "pending":
            self.demo_deadline = None
            return
        if self.demo_deadline is None:
            self.demo_deadline = time.monotonic() + DEMO_START_SECONDS
        try:
            code, body = self._api_post(f"api/jobs/{demo['id']}/start")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            code, body = 0, {"detail": str(exc)}
        if code == 200:
            self.say(f"demo job started: {body.get('layout')} on {len(body.get('placement') or [])} GPUs "
                     f"({self.options.url}jobs/{demo['id']}/)")
            self.demo_deadline = None
        elif time.monotonic() > self.demo_deadline:
            self.say(f"demo job not started: {body.get('detail') or body}; start it on {self.options.url}jobs/"
                     f"{demo['id']}/")
            self.demo_deadline = None
        else:
            return
        demo["state"] = body.get("state", demo["state"])

    def check_children(self, children: list[Child] | None = None) -> None:
        for child in self.broker + self.services + self.agents if children is None else children:
            code = child.poll()
            if code is None or getattr(child, "reported", False):
                continue
            child.reported = True  # type: ignore[attr-defined]
            if child.critical:
                raise StackError(f"{child.name} exited with code {code}; last lines of {child.log_path}:\n{child.log_tail()}")
            self.say(f"{child.name} exited with code {code} (its GPUs will be marked lost); log: {child.log_path}")

    def supervise(self) -> None:
        """After start-up: start again the embedded broker (on its address), a web, worker or
        agent process that exited, with backoff."""
        now = time.monotonic()
        for child in self.broker + self.services + (self.agents if self.options.restart_agents else []):
            state = self.restarts.setdefault(child.name, {"count": 0, "due": None, "since": now})
            code = child.poll()
            if code is None:
                if state["count"] and now - state["since"] > STABLE_SECONDS:
                    state["count"] = 0
                continue
            if state["due"] is None:
                delay = RESTART_BACKOFF_SECONDS[min(state["count"], len(RESTART_BACKOFF_SECONDS) - 1)]
                state["due"] = now + delay
                self.say(f"{child.name} exited with code {code}; starting it again in {delay:.0f} s "
                         f"(log: {child.log_path})")
            elif now >= state["due"]:
                child.kill_group()  # whatever it left in its process group; closes its log
                if child in self.broker:
                    if self._broker_ready(child) != self.env["REDIS_URL"]:  # e.g. its port taken meanwhile
                        state.update(count=state["count"] + 1, due=None, since=now)
                        continue  # (exited: tried again after the next backoff)
                else:
                    child.start(self.env, stdout=None if not self.options.verbose else sys.stdout.buffer)
                state.update(count=state["count"] + 1, due=None, since=now)
                self.say(f"{child.name} started again (pid {child.pid}, restart {state['count']})")
                self.write_state()
        if not self.options.restart_agents:
            self.check_children(self.agents)

    def write_state(self) -> None:
        state = {
            "url": self.options.url,
            "redis_url": self.env["REDIS_URL"],
            "launcher_pid": os.getpid(),
            "pids": {c.name: c.pid for c in self.broker + self.services + self.agents},
            **{k: self.credentials[k] for k in ("username", "password", "token", "agent_tokens")
               if k in self.credentials},
        }
        # Written beside it and renamed over it: a reader (`dynaplane status`, the tests) never
        # sees a half-written file while the launcher records a restarted process's pid.
        path = self.options.var_dir / "stack.json"
        partial = path.with_name(f".stack.json.{os.getpid()}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(state, handle, indent=2)
        os.replace(partial, path)

    def stop(self) -> None:
        stop_in_tiers([self.agents, self.services, self.broker])
        if self._listener is not None:
            self._listener.close()
        try:
            (self.options.var_dir / "stack.json").unlink()
        except FileNotFoundError:
            pass


def _raise_keyboard_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_stack(options: StackOptions) -> int:
    options.var_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(options)
    # Explicit handlers: a shell starts background jobs with SIGINT ignored, and Python
    # keeps it ignored; `kill -INT` must stop the stack all the same.
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    code = 0
    try:
        stack.say(f"var dir {options.var_dir} (logs in {stack.logs})")
        stack.start_broker()
        stack.setup_database()
        stack.start_services()
        health = stack.wait_ready()
        stack.write_state()
        c = stack.credentials
        stack.say(
            f"ready: {options.url}  ({health['agents']['healthy']} agents, {health['gpus']['total']} GPUs)\n"
            f"    login {c['username']} / {c['password']}   API token {c['token']}\n"
            f"    Ctrl-C stops everything."
        )
        stack.start_demo()
        while True:
            stack.supervise()
            if stack.demo_deadline is not None:
                stack.start_demo()
            time.sleep(0.5)
    except KeyboardInterrupt:
        stack.say("stopping ...")
    except StackError as exc:
        print(f"dynaplane up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()
        stack.say("stopped")
    return code
