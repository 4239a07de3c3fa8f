"""Issue 44: agents on hosts of their own. The control plane (web, worker, broker) in the root
namespace, each agent in a network namespace with its own address (tests/support/hosts.py): the
agents reach the broker only over that network, advertise the address other hosts reach them on
(the route to the broker), and their ranks rendezvous and run gloo across it."""
from __future__ import annotations

import os
import sys

import pytest

from agents.runtime.sample_log import read_records
from tests.support.broker import Broker
from tests.support.datasets import assert_each_sample_read_once, loss_steps, real_text_dataset, start_text_job
from tests.support.hosts import Hosts, available
from tests.support.stack import ROOT, StackProcess, wait_for, wait_for_transition_end

pytestmark = [pytest.mark.integration, pytest.mark.hosts, pytest.mark.timeout(420),
              pytest.mark.skipif(available() is not None, reason=f"no test hosts here: {available()}")]

HOSTS = ["host-1", "host-2", "host-3"]


@pytest.fixture
def cluster(tmp_path):
    """(stack, hosts): the control plane on the bridge's address, no agents of its own; one agent
    with 2 virtual GPUs on each of three hosts."""
    hosts = Hosts(HOSTS)
    broker = Broker(tmp_path / "redis", host=hosts.gateway)
    stack = StackProcess(tmp_path / "stack", agents=0, gpus_per_agent=2,
                         env={"DATABASE_URL": None, "REDIS_URL": broker.url})
    stack.argv += ["--host", hosts.gateway]
    stack.start()
    try:
        stack.wait_ready(timeout=120)
        env = {**os.environ, "REDIS_URL": broker.url, "DYNAPLANE_VAR_DIR": str(stack.var_dir), "PYTHONUNBUFFERED": "1"}
        for name in HOSTS:
            log = open(stack.var_dir / f"agent-{name}.log", "wb")
            hosts.popen(name, [sys.executable, "-m", "dynaplane", "agent", "--name", name, "--gpus", "2"],
                        env=env, cwd=ROOT, stdout=log, stderr=log)
        wait_for(lambda: sum(n["state"] == "healthy" for n in stack.get("api/nodes")["results"]) == 3, timeout=90)
        yield stack, hosts
    finally:
        stack.stop()
        hosts.close()
        broker.close()


def test_a_job_trains_across_two_hosts_and_grows_onto_a_third(cluster) -> None:
    stack, hosts = cluster
    nodes = {n["name"]: n for n in stack.get("api/nodes")["results"]}
    assert {name: nodes[name]["host"] for name in HOSTS} == {name: hosts.address(name) for name in HOSTS}
    directory = real_text_dataset(stack, "stdlib-code")
    running = job = start_text_job(stack, "spread", gpus=4, global_batch=12, checkpoint_interval=0, timeout=180)
    url = f"api/jobs/{job['id']}"

    def steps() -> list:
        return loss_steps(stack, job)

    spread = {slot["node"] for slot in running["placement"]}
    assert len(spread) == 2, running["placement"]
    host = running["rendezvous"].rsplit(":", 1)[0]
    assert host in {hosts.address(name) for name in spread}, running["rendezvous"]  # never localhost
    resize = stack.post(f"{url}/resize", {"gpus": 6})
    done, seconds = wait_for_transition_end(stack, resize["id"])
    assert (done["state"], done["verification"]["verified"]) == ("committed", True), done
    grown = stack.get(url, token=True)
    assert {slot["node"] for slot in grown["placement"]} == set(HOSTS) and grown["layout"] == "dp=6"
    last = max(steps())
    wait_for(lambda: max(steps()) > last + 2, timeout=60)
    stack.post(f"{url}/stop", {})
    stopped, _ = wait_for(lambda: (j := stack.get(url, token=True))["state"] == "stopped" and j, timeout=90)
    assert sorted(steps()) == list(range(1, stopped["step"] + 1))
    assert_each_sample_read_once(stopped, directory, 12, 16)
    layouts = {r["layout"] for r in read_records(stopped["checkpoint_dir"]) if "step" in r}
    assert layouts == {"dp=4", "dp=6"}, layouts
    print(f"dp=4 over {sorted(spread)} grew to dp=6 over three hosts, committed {seconds:.1f} s after POST; "
          f"{stopped['step']} steps each recorded once")
