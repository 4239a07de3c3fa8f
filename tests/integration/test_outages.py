"""Issue 43: the control plane's plumbing goes away under a training job and comes back. The
job's ranks never exit, it trains through the outage, and afterwards its record holds every step
exactly once: the reports rank 0 kept are resent (agents/runtime/outbox.py), ingest ignores the
repeats, and no node is marked lost for the silence the outage caused (cluster/shared_hearing.py)."""
from __future__ import annotations

import http.cookiejar
import json
import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from agents.runtime.sample_log import read_records
from tests.support.broker import Broker
from tests.support.datasets import assert_each_sample_read_once, loss_steps, real_text_dataset, start_text_job
from tests.support.stack import StackProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _health_status(stack) -> int:
    return _status(stack, "api/health", token=False)[0]


def _status(stack, path: str, token: bool = True) -> tuple[int, str]:
    """The status of GET path and, for an error, the start of its detail."""
    try:
        stack.get(path, token=token)
        return 200, ""
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            detail = json.loads(body).get("detail", "")
        except ValueError:
            detail = body
        return exc.code, detail[:len("the database is not answering")]


def _trains_through(stack, take_down, bring_back, seconds: float, *, says_503: bool = True, during=None) -> str:
    """A dp=2 job on real text trains; `take_down()`, `seconds` of outage, `bring_back()`; then the
    job's record is checked step by step. Returns a line for the test's output. `says_503`: the
    outage lasts long enough for /api/health to be asked during it; `during(url)`: more checks
    then (url: the job's API path)."""
    directory = real_text_dataset(stack, "stdlib-code")
    running = job = start_text_job(stack, "through", gpus=2, global_batch=4, checkpoint_interval=20)
    url = f"api/jobs/{job['id']}"

    def steps() -> list:
        return loss_steps(stack, job)

    def trained() -> int:  # the last step the ranks trained, from their own records (sample_log.py)
        return max((r["step"] for r in read_records(running["checkpoint_dir"]) if "step" in r), default=0)

    before = trained()
    take_down()
    down_at = time.monotonic()
    time.sleep(min(2.0, seconds))
    assert not says_503 or _health_status(stack) == 503  # the control plane says its plumbing is away
    if during is not None:
        during(url)
    time.sleep(max(0.0, seconds - (time.monotonic() - down_at)))
    trained_then = trained()
    assert trained_then > before + 2, (before, trained_then)  # the ranks trained on through the outage
    bring_back()
    back_at = time.monotonic()
    # rank 0's kept reports arrive: the record reaches the steps trained during the outage
    wait_for(lambda: _health_status(stack) == 200 and max(steps()) >= trained_then, timeout=90)
    caught_up = time.monotonic() - back_at
    stack.post(f"{url}/stop", {})
    stopped, _ = wait_for(lambda: (j := stack.get(url, token=True))["state"] == "stopped" and j, timeout=90)
    transitions = stack.get(f"api/transitions?job={job['id']}", token=True)["results"]
    assert [t for t in transitions if t["kind"] == "restore"] == [], transitions  # no rank died, no restore
    assert all(n["state"] == "healthy" for n in stack.get("api/nodes")["results"])  # nobody marked lost
    metrics = stack.get(f"{url}/live", token=True)["metrics"]
    xs = metrics["loss"]["x"]
    assert sorted(xs) == list(range(1, stopped["step"] + 1)), xs  # every step exactly once, no gap
    assert len(metrics["loss"]["y"]) == len(xs)
    assert_each_sample_read_once(stopped, directory, 4, 16)
    return (f"{seconds:.0f} s outage: {trained_then - before} steps trained during it, the record caught up "
            f"{caught_up:.1f} s after it was back, {stopped['step']} steps each recorded once")


@pytest.mark.parametrize("seconds", [5, 30, 120])
def test_an_external_redis_killed_while_a_job_trains(tmp_path, seconds) -> None:
    broker = Broker(tmp_path / "redis")
    stack = StackProcess(tmp_path / "stack", agents=1, gpus_per_agent=2,
                         env={"DATABASE_URL": None, "REDIS_URL": broker.url})
    stack.start()
    try:
        stack.wait_ready(timeout=120)
        print(_trains_through(stack, broker.down, broker.up, seconds))
    finally:
        stack.stop()
        broker.close()


def test_the_embedded_valkey_killed_is_started_again_and_the_job_trains_on(tmp_path) -> None:
    stack = StackProcess(tmp_path / "stack", agents=1, gpus_per_agent=2, env={"DATABASE_URL": None, "REDIS_URL": None})
    stack.start()
    try:
        stack.wait_ready(timeout=120)
        valkey = stack.child_pids()["valkey"]

        def kill() -> None:
            os.killpg(valkey, signal.SIGKILL)

        def started_again() -> None:
            wait_for(lambda: "valkey started again" in stack.output(), timeout=30)

        print(_trains_through(stack, kill, started_again, 3, says_503=False))  # (the launcher is quick)
        assert stack.process.poll() is None  # the stack stayed up
    finally:
        stack.stop()


def _signed_in(stack):
    """An opener holding a signed-in session (the login form, as a browser posts it)."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    login = stack.url + "accounts/login/"
    opener.open(login, timeout=10).read()
    csrf = next(cookie.value for cookie in jar if cookie.name == "csrftoken")
    form = urllib.parse.urlencode({"username": stack.state["username"], "password": stack.state["password"],
                                   "csrfmiddlewaretoken": csrf}).encode()
    opener.open(urllib.request.Request(login, data=form, headers={"Referer": login}), timeout=10).read()
    assert any(cookie.name == "sessionid" for cookie in jar)
    return opener


def test_postgresql_restarted_while_a_job_trains(tmp_path) -> None:
    """The database (a cluster of the test's own) stopped for 15 s and started again: the API and
    the pages answer 503 saying so (no 500), the worker's reports wait and go in afterwards."""
    from tests.support.postgres import PostgresCluster

    database = PostgresCluster()
    stack = StackProcess(tmp_path / "stack", agents=1, gpus_per_agent=2,
                         env={"DATABASE_URL": database.url, "REDIS_URL": None})
    stack.start()
    try:
        stack.wait_ready(timeout=120)

        browser = _signed_in(stack)

        def answers_503(url: str) -> None:
            assert _status(stack, url) == (503, "the database is not answering")
            with pytest.raises(urllib.error.HTTPError) as page:  # a page, not an API view
                browser.open(stack.url + "jobs/", timeout=10)
            assert page.value.code == 503 and b"database unavailable" in page.value.read()

        print(_trains_through(stack, database.stop, database.start, 15, during=answers_503))
        logs = (stack.var_dir / "logs" / "web.log").read_text(errors="replace")
        assert " 500 " not in logs.replace('"', " ")  # daphne's access log: no request answered 500
    finally:
        stack.stop()
        database.close()


@pytest.mark.parametrize("what", ["redis", "postgresql"])
def test_an_outage_while_a_resize_prepares_ends_the_resize_committed_or_aborted_and_the_job_trains_on(
        tmp_path, what) -> None:
    """The broker (an external Redis) or the database stopped for 10 s while a dp=2 job grows to
    4 GPUs: the resize ends committed, or aborted with its reason; either way the job trains
    on and its record holds every step once."""
    from tests.support.postgres import PostgresCluster

    outage = Broker(tmp_path / "redis") if what == "redis" else PostgresCluster()
    env = ({"DATABASE_URL": None, "REDIS_URL": outage.url} if what == "redis"
           else {"DATABASE_URL": outage.url, "REDIS_URL": None})
    down, up = (outage.down, outage.up) if what == "redis" else (outage.stop, outage.start)
    stack = StackProcess(tmp_path / "stack", agents=2, gpus_per_agent=2, env=env)
    stack.start()
    try:
        stack.wait_ready(timeout=120)
        directory = real_text_dataset(stack, "stdlib-code")
        job = start_text_job(stack, "grows", gpus=2, global_batch=4, checkpoint_interval=20)
        url = f"api/jobs/{job['id']}"

        def steps() -> list:
            return loss_steps(stack, job)

        resize = stack.post(f"{url}/resize", {"gpus": 4})
        wait_for(lambda: stack.get(f"api/transitions/{resize['id']}", token=True)["state"] != "planned", timeout=30)
        down()
        time.sleep(10)
        up()
        back = time.monotonic()
        done, _ = wait_for(lambda: _status(stack, "api/health")[0] == 200 and (
            t := stack.get(f"api/transitions/{resize['id']}", token=True))["state"] in (
            "committed", "aborted", "rolled_back") and t, timeout=240)
        assert done["state"] == "committed" or ";" in done["reason"], done  # aborted: the request; why
        ended = time.monotonic() - back
        last = max(steps())
        wait_for(lambda: (j := stack.get(url, token=True))["state"] == "running" and max(steps()) > last + 2,
                 timeout=60)
        stack.post(f"{url}/stop", {})
        stopped, _ = wait_for(lambda: (j := stack.get(url, token=True))["state"] == "stopped" and j, timeout=90)
        xs = stack.get(f"{url}/live", token=True)["metrics"]["loss"]["x"]
        assert sorted(xs) == list(range(1, stopped["step"] + 1)), xs
        assert_each_sample_read_once(stopped, directory, 4, 16)
        print(f"{what} down 10 s while the resize prepared: {done['state']} ({done['reason'] or 'verified'}) "
              f"{ended:.1f} s after it was back; {stopped['step']} steps each recorded once")
    finally:
        stack.stop()
        outage.close()
