"""Child processes of the launcher: started in their own process group, tied to the
launcher's life, stopped politely then forcefully, with nothing left behind."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """In the child, before exec: own process group; SIGTERM if the launcher dies."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still runs
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    critical: bool
    process: subprocess.Popen | None = None
    log_file: IO[bytes] | None = field(default=None, repr=False)
    own_env: dict[str, str] = field(default_factory=dict, repr=False)  # this child's on top of the shared env
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (a listening socket several web processes share)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, env: dict[str, str], stdout: int | IO[bytes] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.argv,
            env={**env, **self.own_env},
            stdout=stdout if stdout is not None else self.log_file,
            stderr=self.log_file,
            stdin=subprocess.DEVNULL,
            preexec_fn=_child_setup,
            pass_fds=self.pass_fds,
        )

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def terminate(self) -> None:
        """Ask the group leader to stop (it shuts down what it started)."""
        if self.process and self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL whatever is left in the child's process group."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.log_file:
            self.log_file.close()
            self.log_file = None


def stop_in_tiers(tiers: list[list[Child]], timeout: float = 15.0) -> None:
    """Stop tier after tier (e.g. agents, then workers, then the broker); the children of
    one tier stop together, each tier within `timeout` seconds before SIGKILL."""
    for tier in tiers:
        for child in tier:
            child.terminate()
        deadline = time.monotonic() + timeout
        while any(c.poll() is None for c in tier) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in tier:
            child.kill_group()
