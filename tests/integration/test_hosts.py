"""Issue 44: agents on hosts of their own. The control plane (web, worker, its embedded broker with
a password) in the root namespace, `dynaplane up --host` on the bridge's address; each agent in a
network namespace with its own address (dynaplane/netns_hosts.py), enrolled with a token of its own
(`dynaplane agent --join URL`, token in its environment): the agents reach the broker only over
that network, advertise the address other hosts reach them on (the route to the broker), and
their ranks rendezvous and run gloo across it. From an agent host, what is not an enrolled agent
speaking of its own jobs is refused, and nothing of the stack answers without authentication."""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request

import pytest

from agents.runtime.sample_log import read_records
from tests.support.datasets import assert_each_sample_read_once, loss_steps, real_text_dataset, start_text_job
from tests.support.host_cluster import host_cluster
from dynaplane.netns_hosts import available
from tests.support.stack import wait_for, wait_for_transition_end

pytestmark = [pytest.mark.integration, pytest.mark.hosts, pytest.mark.timeout(420),
              pytest.mark.skipif(available() is not None, reason=f"no test hosts here: {available()}")]

HOSTS = ["host-1", "host-2", "host-3"]


@pytest.fixture
def cluster(tmp_path):
    """(stack, hosts): the control plane on the bridge's address with its embedded broker, no
    agents of its own; one agent with 2 virtual GPUs on each of three hosts, each enrolled with
    a token of its own (tests/support/host_cluster.py). The elastic scheduler resizes a job 5 s
    after its last change at the earliest (not 300 s)."""
    with host_cluster(tmp_path / "stack", HOSTS, env={"DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS": "5"}) as made:
        yield made


@pytest.fixture
def cluster_with_unshared_host(tmp_path):
    """As `cluster`, but host-3 sees storage of its own at the checkpoint root (not the shared one)."""
    with host_cluster(tmp_path / "stack", HOSTS, own_checkpoints=("host-3",)) as made:
        yield made


def passed_preflights(stack, job_id: int) -> list[dict]:
    """The job's pre-flights, oldest first, each checked to have passed on every node (gloo across
    the hosts included)."""
    rows = stack.get(f"api/jobs/{job_id}/preflights", token=True)[::-1]
    for row in rows:
        assert row["state"] == "passed", row
        for node in row["nodes"]:
            assert node["checks"] and all(check["ok"] for check in node["checks"]), node
        n = len(row["nodes"])
        assert all(any(c["name"] == "all-reduce" and c["detail"].startswith(f"{n} nodes summed over gloo")
                       for c in node["checks"]) for node in row["nodes"]), row
    return rows


def test_a_job_trains_across_two_hosts_grows_onto_a_third_survives_its_link_cut_and_grows_back(cluster) -> None:
    """The job starts on two hosts; made elastic up to 6 GPUs, the elastic scheduler grows it onto
    the third; that host's link is cut (no reset reaches anyone): the others' collectives give up
    after the step timeout, and the job goes on on them without a checkpoint within 30 s. The link
    comes back, the host's agent rejoins, and the scheduler grows the job onto it again by itself.
    Every switch verified and preceded by a pre-flight across its hosts; every step recorded
    once, every sample read once."""
    stack, hosts = cluster
    nodes = {n["name"]: n for n in stack.get("api/nodes")["results"]}
    assert {name: nodes[name]["host"] for name in HOSTS} == {name: hosts.address(name) for name in HOSTS}
    directory = real_text_dataset(stack, "stdlib-code")
    running = job = start_text_job(stack, "spread", gpus=4, global_batch=12, checkpoint_interval=0, timeout=180)
    url = f"api/jobs/{job['id']}"

    def steps() -> list:
        return loss_steps(stack, job)

    def elastic_grow(after: set[int]) -> dict:
        """The elastic scheduler's next resize of the job (not one of `after`), once it ended."""
        found, _ = wait_for(lambda: next((t for t in stack.get(f"api/transitions?job={job['id']}", token=True)["results"]
                                          if t["kind"] == "resize" and t["id"] not in after), None), timeout=90)
        assert found["reason"].startswith("grew to 6 (dp=6)"), found["reason"]
        return wait_for_transition_end(stack, found["id"])[0]

    spread = {slot["node"] for slot in running["placement"]}
    assert len(spread) == 2, running["placement"]
    host = running["rendezvous"].rsplit(":", 1)[0]
    assert host in {hosts.address(name) for name in spread}, running["rendezvous"]  # never localhost
    asked = time.monotonic()
    stack.post(f"{url}/elastic", {"elastic": True, "min_gpus": 4, "max_gpus": 6}, method="PATCH")
    resize = done = elastic_grow(set())
    seconds = time.monotonic() - asked
    assert (done["state"], done["verification"]["verified"]) == ("committed", True), done
    grown = stack.get(url, token=True)
    assert {slot["node"] for slot in grown["placement"]} == set(HOSTS) and grown["layout"] == "dp=6"
    last = max(steps())
    wait_for(lambda: max(steps()) > last + 2, timeout=60)

    third = next(name for name in HOSTS if name not in spread)
    hosts.cut(third)
    cut_at = time.monotonic()
    last = max(steps())
    survived, _ = wait_for(lambda: (j := stack.get(url, token=True))["state"] == "running" and j["layout"] == "dp=4"
                           and max(steps()) > last and j, timeout=90)
    recovered = time.monotonic() - cut_at
    assert third not in {slot["node"] for slot in survived["placement"]}
    restore = next(t for t in stack.get(f"api/transitions?job={job['id']}", token=True)["results"]
                   if t["kind"] == "restore")
    assert (restore["state"], restore["verification"]["verified"]) == ("committed", True), restore
    assert "without a checkpoint" in restore["reason"], restore["reason"]
    assert recovered < 30, f"training again on the other hosts {recovered:.1f} s after the link was cut"

    hosts.mend(third)
    wait_for(lambda: next(n for n in stack.get("api/nodes")["results"] if n["name"] == third)["state"] == "healthy"
             and sum(g["state"] == "free" for g in stack.get("api/gpus?node=" + third, token=True)["results"]) == 2,
             timeout=120)
    regrow = done = elastic_grow({resize["id"]})  # by itself: the host's GPUs are free again
    assert (done["state"], done["verification"]["verified"]) == ("committed", True), done
    back = stack.get(url, token=True)
    assert third in {slot["node"] for slot in back["placement"]} and back["layout"] == "dp=6"
    last = max(steps())
    wait_for(lambda: max(steps()) > last + 2, timeout=60)
    stack.post(f"{url}/stop", {})
    stopped, _ = wait_for(lambda: (j := stack.get(url, token=True))["state"] == "stopped" and j, timeout=90)
    # Every step trained once (each reports its time); only the step the survivors went on from
    # may lack a loss: the cut may have broken the all-reduce that sums it, after its update.
    trained = stack.get(f"{url}/live", token=True)["metrics"]["step_seconds"]["x"]
    assert sorted(trained) == list(range(1, stopped["step"] + 1)), sorted(trained)
    assert set(trained) - set(steps()) <= {restore["step"]}, sorted(set(trained) - set(steps()))
    assert_each_sample_read_once(stopped, directory, 12, 16)
    layouts = {r["layout"] for r in read_records(stopped["checkpoint_dir"]) if "step" in r}
    assert layouts == {"dp=4", "dp=6"}, layouts
    checked = passed_preflights(stack, job["id"])  # the start and both grows, each across hosts
    assert [len(row["nodes"]) for row in checked] == [2, 3, 3], checked
    assert [row["transition"] for row in checked] == [None, resize["id"], regrow["id"]], checked
    print(f"dp=4 over {sorted(spread)} grew to dp=6 over three hosts (elastic), committed {seconds:.1f} s after "
          f"the PATCH; "
          f"{third}'s link cut: training on the others {recovered:.1f} s later; the scheduler grew it back onto it "
          f"({regrow['reason']}); "
          f"{stopped['step']} steps each recorded once")


@pytest.fixture
def cluster_stalling_in_transfer(tmp_path):
    """As `cluster`, but host-3's joining ranks (processes 4 and 5 of a 4 -> 6 grow's world) stall
    once the transfer has begun (fault injection), so that a cut lands while the state moves."""
    stall = {"DYNAPLANE_FAULT": "stall-in-transfer:4:120,stall-in-transfer:5:120"}
    with host_cluster(tmp_path / "stack", HOSTS, agent_env={"host-3": stall}) as made:
        yield made


def test_a_link_cut_while_a_grow_moves_the_state_rolls_back_and_the_job_trains_on(
        cluster_stalling_in_transfer) -> None:
    """A job on two hosts grows onto the third; while the state moves, the third host's link is
    cut. The old ranks' transfer waits only the step timeout for a peer (not the switch's long
    wait): they roll back to the old layout with the state they kept and train on within 30 s of
    the cut, without a checkpoint; every step recorded once, every sample read once."""
    stack, hosts = cluster_stalling_in_transfer
    directory = real_text_dataset(stack, "stdlib-code")
    job = start_text_job(stack, "cut-mid-grow", gpus=4, global_batch=12, checkpoint_interval=0, timeout=180)
    url = f"api/jobs/{job['id']}"
    assert {slot["node"] for slot in job["placement"]} == {"host-1", "host-2"}, job["placement"]
    grow = stack.post(f"{url}/resize", {"gpus": 6})
    assert {slot["node"] for slot in grow["destination_placement"] if slot["rank"] >= 4} == {"host-3"}, grow
    wait_for(lambda: stack.get(f"api/transitions/{grow['id']}", token=True)["state"] == "transferring", timeout=120)
    last = max(loss_steps(stack, job))
    hosts.cut("host-3")
    cut_at = time.monotonic()
    done, _ = wait_for(lambda: (t := stack.get(f"api/transitions/{grow['id']}", token=True))["state"]
                       in ("rolled_back", "aborted", "committed") and t, timeout=90)
    back, _ = wait_for(lambda: max(loss_steps(stack, job)) > last and stack.get(url, token=True), timeout=60)
    recovered = time.monotonic() - cut_at
    assert done["state"] == "rolled_back", done
    assert "Timed out" in done["reason"] or "timed out" in done["reason"].lower(), done["reason"]
    assert (back["state"], back["layout"], back["error"]) == ("running", "dp=4", ""), back
    assert recovered < 30, f"training again on the old layout {recovered:.1f} s after the link was cut"
    last = max(loss_steps(stack, job))
    wait_for(lambda: max(loss_steps(stack, job)) > last + 2, timeout=60)
    stack.post(f"{url}/stop", {})
    stopped, _ = wait_for(lambda: (j := stack.get(url, token=True))["state"] == "stopped" and j, timeout=90)
    trained = stack.get(f"{url}/live", token=True)["metrics"]["step_seconds"]["x"]
    assert sorted(trained) == list(range(1, stopped["step"] + 1)), sorted(trained)
    assert set(trained) == set(loss_steps(stack, job)), sorted(set(trained) ^ set(loss_steps(stack, job)))
    assert_each_sample_read_once(stopped, directory, 12, 16)
    print(f"host-3's link cut while the grow moved the state: rolled back, training again on dp=4 "
          f"{recovered:.1f} s after the cut; {stopped['step']} steps each recorded once")


# Run on an agent host by a process that is not the agent: it holds what an agent's host holds
# (the broker URL with its password from joining, a token of its own) and tries to speak out of turn.
INTRUDER = r"""
import json, sys
import redis
from celery import Celery
from agents import protocol
from agents.seal import key_of_token, seal
from datetime import datetime, timezone

broker, node, token, revoked, job_id = sys.argv[1:6]
app = Celery("intruder", broker=broker, set_as_current=False)
now = datetime.now(timezone.utc).isoformat()
failed = protocol.job_report(job_id=int(job_id), node=node, kind="failed", ranks=(0,), error="lies",
                             sent_at=now).model_dump(mode="json")
# 1. its own key, about a job its node does not serve
app.send_task(protocol.CONTROL_JOB_REPORT, args=[failed], queue=protocol.CONTROL_QUEUE,
              kwargs={"seal": seal(key_of_token(token), node, protocol.CONTROL_JOB_REPORT, failed)})
# 2. a revoked key
app.send_task(protocol.CONTROL_JOB_REPORT, args=[failed], queue=protocol.CONTROL_QUEUE,
              kwargs={"seal": seal(key_of_token(revoked), node, protocol.CONTROL_JOB_REPORT, failed)})
# 3. the broker without its password
host, port = broker.rsplit("@", 1)[1].split("/")[0].split(":")
answers = {}
for command in (("LPUSH", protocol.CONTROL_QUEUE, "x"), ("KEYS", "*"), ("CONFIG", "GET", "requirepass")):
    try:
        answers[command[0]] = repr(redis.Redis(host=host, port=int(port), socket_timeout=5).execute_command(*command))
    except redis.RedisError as exc:
        answers[command[0]] = f"{type(exc).__name__}: {exc}"
print(json.dumps(answers))
"""


def test_from_an_agent_host_nothing_but_an_enrolled_agent_about_its_own_jobs_is_heard(
        cluster_with_unshared_host) -> None:
    """... and a job that would span a host without the shared checkpoint storage is not started:
    its pre-flight names the host and the check, and the job stays pending with its GPUs free."""
    stack, hosts = cluster_with_unshared_host
    job = stack.post("api/jobs", {"name": "guarded", "model": "tiny-gpt", "gpus": 2, "global_batch": 4,
                                  "seq_len": 16, "checkpoint_interval": 0})
    url = f"api/jobs/{job['id']}"
    running, _ = wait_for(lambda: (j := stack.get(url))["state"] == "running" and (j["step"] or 0) >= 3 and j,
                          timeout=120)
    served = {slot["node"] for slot in running["placement"]}
    intruder = next(name for name in HOSTS if name not in served)
    own = stack.post("api/agent-tokens", {"node": intruder, "note": "the intruder's"})["token"]
    spare = stack.post("api/agent-tokens", {"node": intruder, "note": "revoked"})
    stack.post(f"api/agent-tokens/{spare['key_id']}/revoke", {})
    time.sleep(6)  # past the workers' key cache (agent_auth.KEY_CACHE_SECONDS)
    joined = json.loads(urllib.request.urlopen(urllib.request.Request(
        stack.url + "api/agents/join", data=json.dumps({"token": own}).encode(), method="POST",
        headers={"Content-Type": "application/json"}), timeout=10).read())
    done = hosts.run(intruder, [sys.executable, "-c", INTRUDER, joined["broker_url"], intruder, own, spare["token"],
                                str(job["id"])], timeout=60)
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(answer.startswith("NoPermissionError") or "NOAUTH" in answer for answer in answers.values()), answers
    worker_log = stack.var_dir / "logs" / "worker.log"
    wait_for(lambda: f"node {intruder} holds no ranks of job {job['id']}" in worker_log.read_text()
             and "was revoked" in worker_log.read_text(), timeout=30)
    step = stack.get(url)["step"]
    wait_for(lambda: stack.get(url)["step"] >= step + 3, timeout=60)  # trains on
    after = stack.get(url)
    assert (after["state"], after["error"], after["layout"]) == ("running", "", running["layout"])

    stack.post(f"{url}/stop", {})
    wait_for(lambda: stack.get(url)["state"] == "stopped", timeout=90)
    refused_at = time.monotonic()
    wide = stack.post("api/jobs", {"name": "wide", "model": "tiny-gpt", "gpus": 6, "global_batch": 6,
                                   "seq_len": 16, "checkpoint_interval": 0})
    back, _ = wait_for(lambda: (j := stack.get(f"api/jobs/{wide['id']}", token=True))["state"] == "pending" and j,
                       timeout=90)
    took = time.monotonic() - refused_at
    assert back["error"].startswith(f"pre-flight failed: host host-3 ({hosts.address('host-3')}): shared storage: "), \
        back["error"]
    assert "is other storage on this host than on" in back["error"] and back["placement"] == [], back
    assert sum(g["state"] == "free" for g in stack.get("api/gpus", token=True)["results"]) == 6
    [row] = stack.get(f"api/jobs/{wide['id']}/preflights", token=True)
    by_node = {node["node"]: {c["name"]: c["ok"] for c in node["checks"]} for node in row["nodes"]}
    assert all(checks["all-reduce"] for checks in by_node.values()), by_node  # the network is fine
    assert [name for name, checks in by_node.items() if not all(checks.values())] == ["host-3"], by_node
    print(f"refused from {intruder}: a report for job {job['id']} it does not serve, one under a revoked key; "
          f"the broker without its password answered {answers}; a job across host-3 (storage of its own) "
          f"refused by its pre-flight {took:.1f} s after the POST began, back to pending")


def listening_sockets(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets these processes listen on (/proc/net/tcp, their fds)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            address, port = fields[1].split(":")
            found.add((socket.inet_ntoa(bytes.fromhex(address)[::-1]), int(port, 16)))
    return found


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        seen.add(pid)
        todo += children.get(pid, [])
    return seen


PROBE = r"""
import json, socket, sys, urllib.error, urllib.request
host, port = sys.argv[1], int(sys.argv[2])
found = {}
for path in ("api/jobs", "api/nodes", "api/agent-tokens", "api/schema/", "api/health", "", "admin/"):
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/{path}"), timeout=5) as response:
            found[path] = [response.status, response.geturl(), response.read(400).decode(errors="replace")]
    except urllib.error.HTTPError as exc:
        found[path] = [exc.code, "", ""]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        found[path] = ["not http", "", str(exc)]
        break
if found.get("api/jobs", [""])[0] == "not http":
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"*2\r\n$4\r\nKEYS\r\n$1\r\n*\r\n")
        found = {"resp": s.recv(200).decode(errors="replace")}
print(json.dumps(found))
"""


def test_no_port_of_the_stack_answers_another_host_without_authentication(cluster) -> None:
    stack, hosts = cluster
    pids = set()
    for pid in stack.state["pids"].values():
        pids |= descendants(pid)
    exposed = {(a, p) for a, p in listening_sockets(pids) if not a.startswith("127.")}
    assert exposed, "the stack listens on no address another host reaches"
    probed = {}
    for address, port in sorted(exposed):
        target = hosts.gateway if address == "0.0.0.0" else address
        done = hosts.run(HOSTS[0], [sys.executable, "-c", PROBE, target, str(port)], timeout=60)
        assert done.returncode == 0, done.stderr
        answers = probed[port] = json.loads(done.stdout.strip().splitlines()[-1])
        if "resp" in answers:  # the broker: the unauthenticated may PING and nothing else
            assert "NOPERM" in answers["resp"] or "NOAUTH" in answers["resp"], answers
            continue
        for path in ("api/jobs", "api/nodes", "api/agent-tokens", "api/schema/"):
            assert answers[path][0] in (401, 403), (port, path, answers[path])
        for path in ("", "admin/"):  # the pages: to the sign-in page
            assert "login" in answers[path][1], (port, path, answers[path])
        assert json.loads(answers["api/health"][2] or "{}").keys() <= {"status"}, answers["api/health"]
    print(f"listening beyond loopback: {sorted(exposed)}; each refused an unauthenticated caller")
