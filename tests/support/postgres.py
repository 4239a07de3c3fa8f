"""A PostgreSQL cluster of a test's own (initdb in a temporary directory, its own port, trust
auth), which the test stops and starts again: the database restarts of issue 43. Run as the
`postgres` system user when the tests run as root (PostgreSQL refuses root)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.support.broker import free_port


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else (Path(shutil.which("pg_ctl")).parent if shutil.which("pg_ctl") else None)


class PostgresCluster:
    """In a directory of its own under /tmp (the `postgres` user cannot enter a root-only test
    directory), removed by close()."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        if self.bin is None:
            raise RuntimeError("no PostgreSQL server binaries (pg_ctl, initdb) on this machine")
        directory = Path(tempfile.mkdtemp(prefix="dynaplane-pg-"))
        self.directory, self.port = directory, free_port()
        self.data, self.log = directory / "data", directory / "server.log"
        if os.geteuid() == 0:
            shutil.chown(directory, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "dynaplane")
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/dynaplane"

    def _run(self, tool: str, *args: str) -> None:
        argv = [str(self.bin / tool), *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, capture_output=True, cwd="/")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-o",
                  f"-p {self.port} -c listen_addresses=127.0.0.1 -c fsync=off -k {self.directory}", "start")

    def stop(self) -> None:
        """As a restart for an upgrade does: connections are cut (fast shutdown)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)
