"""Issue 47: several web processes behind one address share the channel layer.

`dynaplane up --web 2`: two daphne processes accept on the one listening socket the launcher
opened. Requests are served by both; websockets opened on either get every event of their
stream, whichever process's request caused it.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.stack import stack_of_its_own

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REDIS_DB = 13
SOCKETS = 12


@pytest.fixture(scope="module")
def two_web(tmp_path_factory):
    with stack_of_its_own(tmp_path_factory.mktemp("two-web"), REDIS_DB, agents=0, web=2) as stack:
        yield stack


def served(stack, name: str, needle: str) -> int:
    return (stack.var_dir / "logs" / f"{name}.log").read_text(errors="replace").count(needle)


def test_two_web_processes_serve_one_port_and_every_socket_gets_every_event(two_web) -> None:
    stack = two_web
    for _ in range(40):
        stack.get("api/health")
    assert served(stack, "web", "GET /api/health") > 0 and served(stack, "web-2", "GET /api/health") > 0

    async def follow() -> list[list[dict]]:
        from websockets.asyncio.client import connect

        url = stack.url.replace("http://", "ws://") + "ws/cluster/"
        headers = {"Authorization": f"Token {stack.state['token']}"}
        sockets = [await connect(url, additional_headers=headers) for _ in range(SOCKETS)]
        try:
            for socket in sockets:
                assert json.loads(await asyncio.wait_for(socket.recv(), 10))["type"] == "hello"
            await asyncio.to_thread(stack.post, "api/jobs", {"name": "two-web", "model": "tiny-gpt",
                                                             "layout": "dp=1", "start": False})
            return [[json.loads(await asyncio.wait_for(socket.recv(), 10))] for socket in sockets]
        finally:
            for socket in sockets:
                await socket.close()

    got = asyncio.run(follow())
    assert all(events[0]["type"] == "job" and events[0]["job"]["name"] == "two-web" for events in got)
    # (the sockets were spread over both processes: each logs the ones it accepted)
    assert served(stack, "web", "WSCONNECT /ws/cluster/") + served(stack, "web-2", "WSCONNECT /ws/cluster/") \
        == SOCKETS
    assert served(stack, "web", "WSCONNECT /ws/cluster/") > 0 and served(stack, "web-2", "WSCONNECT /ws/cluster/") > 0
