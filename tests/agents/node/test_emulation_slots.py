"""An agent runs at most its slots' worth of emulations and never makes a job order wait
behind them: a real Celery worker (the agent's app, its thread pool sized as `dynaplane
agent` sizes it) on real Redis, with the emulation's body held open by the test."""
from __future__ import annotations

import json
import os
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import signals
from celery.contrib.testing.worker import start_worker

from agents import protocol
from agents.seal import key_of_token, seal, token_new
from agents.node import app as agent_app
from agents.node.config import AgentConfig
from agents.node.emulation_slots import EmulationSlots, pool_size

pytestmark = pytest.mark.timeout(120)


def test_a_full_agent_requeues_instead_of_waiting() -> None:
    slots, release, running = EmulationSlots(1), threading.Event(), threading.Event()
    requeued: list[str] = []

    def held() -> None:
        running.set()
        release.wait(10)

    first = threading.Thread(target=slots.run_or_requeue, args=(held, lambda: requeued.append("first")))
    first.start()
    assert running.wait(5)
    started = time.monotonic()
    assert slots.run_or_requeue(lambda: pytest.fail("ran in a taken slot"), lambda: requeued.append("second")) is False
    assert time.monotonic() - started < 0.5 and requeued == ["second"]
    release.set()
    first.join(5)
    ran: list[int] = []
    assert slots.run_or_requeue(lambda: ran.append(1), lambda: requeued.append("third")) is True
    assert ran == [1] and requeued == ["second"]  # the slot is free again once the run ends, even after an error
    with pytest.raises(RuntimeError):
        slots.run_or_requeue(lambda: (_ for _ in ()).throw(RuntimeError("boom")), lambda: None)
    assert slots.run_or_requeue(lambda: ran.append(2), lambda: None) is True
    with pytest.raises(ValueError, match="at least 1"):
        EmulationSlots(0)


@pytest.fixture
def broker_url():
    url = urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path="/6"))
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()


def test_job_orders_run_while_every_emulation_slot_is_busy(broker_url, monkeypatch) -> None:
    release, bodies = threading.Event(), []

    def emulation(app, agent, order) -> None:  # the run's body, held until the test lets it end
        bodies.append(order["run_id"])
        release.wait(60)

    monkeypatch.setattr(agent_app, "run_emulation", emulation)
    config = AgentConfig(name="node-9", gpus=1, device="cpu", broker_url=broker_url, heartbeat_seconds=60,
                         key=key_of_token(token_new()))
    app, _ = agent_app.build_app(config, emulation_slots=1)
    stopped = threading.Event()

    def ran(sender=None, **_: object) -> None:
        if sender is not None and sender.name == protocol.NODE_JOB_STOP:
            stopped.set()

    signals.task_postrun.connect(ran, weak=False)
    try:
        with start_worker(app, pool="threads", concurrency=pool_size(1), perform_ping_check=False,
                          queues=[config.queue, protocol.EMULATE_QUEUE], loglevel="WARNING"):
            for run_id in (1, 2, 3):  # one more than the pool has threads for order-free work
                app.send_task(protocol.EMULATE_RUN, args=[{"run_id": run_id}], queue=protocol.EMULATE_QUEUE)
            deadline = time.monotonic() + 20
            while not bodies and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # the other two have been taken and sent back by now
            assert len(bodies) == 1, bodies
            sent_at = time.monotonic()
            order = {"job_id": 4242}  # sealed as the control plane seals it: the agent takes no other
            app.send_task(protocol.NODE_JOB_STOP, args=[order], queue=config.queue,
                          kwargs={"seal": seal(config.key, config.name, protocol.NODE_JOB_STOP, order)})
            assert stopped.wait(10), "the stop order waited behind the emulations"
            print(f"job order served in {time.monotonic() - sent_at:.2f} s with the emulation slot busy")
            release.set()
            while len(bodies) < 3 and time.monotonic() < deadline + 30:
                time.sleep(0.2)
            assert sorted(bodies) == [1, 2, 3]  # the requeued ones ran once the slot was free
    finally:
        release.set()
        signals.task_postrun.disconnect(ran)
    leftover = redis.Redis.from_url(broker_url).lrange(protocol.EMULATE_QUEUE, 0, -1)
    assert [json.loads(m) for m in leftover] == []
