"""A node's part of a pre-flight (agents/node/preflight.py), run for real: each node in a thread
of its own (a real TCPStore and gloo all-reduce over loopback, as the agents run them), and a
node whose checkpoint folder is storage of its own in a mount namespace of its own (as a host
that does not mount the shared checkpoint root sees it)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agents import protocol
from agents.node.preflight import port_check, run_preflight
from agents.runtime.preflight_meeting import probe_path
from tests.support.broker import free_port


def _order(tmp_path: Path, nodes=("a", "b", "c"), port: int | None = None, **fields) -> protocol.PreflightOrder:
    defaults = dict(checkpoint_dir=str(tmp_path / "ckpt" / "j"), read_dirs=(str(tmp_path),), timeout_seconds=6)
    return protocol.PreflightOrder(preflight_id=7, job_id=3, job_name="j", nodes=tuple(nodes),
                                   rendezvous=f"127.0.0.1:{port or free_port()}", **{**defaults, **fields})


def _together(order: protocol.PreflightOrder, nodes) -> dict[str, protocol.PreflightReport]:
    reports: dict[str, protocol.PreflightReport] = {}
    threads = [threading.Thread(target=lambda n=n: reports.__setitem__(n, run_preflight(order, n))) for n in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return reports


def _checks(report: protocol.PreflightReport) -> dict[str, tuple[bool, str]]:
    return {check.name: (check.ok, check.detail) for check in report.checks}


def test_three_nodes_pass_every_check_and_free_the_port(tmp_path) -> None:
    order = _order(tmp_path)
    reports = _together(order, order.nodes)
    assert all(report.ok for report in reports.values()), reports
    assert list(_checks(reports["a"])) == ["storage", "data", "port", "rendezvous", "all-reduce"]
    assert list(_checks(reports["b"])) == ["storage", "data", "rendezvous", "all-reduce", "shared storage"]
    assert _checks(reports["c"])["all-reduce"][1].startswith("3 nodes summed over gloo")
    assert _checks(reports["c"])["shared storage"] == (True, "read the probe a wrote")
    assert not probe_path(order.checkpoint_dir, 7).exists()  # removed once every node read it
    assert port_check(int(order.rendezvous.rsplit(":", 1)[1])).ok  # rank 0 can bind it next


def test_a_node_that_does_not_come_is_named_by_the_others(tmp_path) -> None:
    order = _order(tmp_path, timeout_seconds=3)
    reports = _together(order, ("a", "b"))
    for node in ("a", "b"):
        assert _checks(reports[node])["rendezvous"] == (
            False, f"c did not join the rendezvous {order.rendezvous} within 3 s")


def test_a_store_closed_while_a_node_waits_names_the_missing_node_and_raises_nothing(tmp_path) -> None:
    """The first node closes its store when its own wait ends, which under load can be a moment
    before another node's wait ends: that node still reports, naming the node that did not come."""
    import time

    from torch.distributed import PrefixStore, TCPStore

    order = _order(tmp_path, timeout_seconds=30)
    host, port = order.rendezvous.rsplit(":", 1)
    server = TCPStore(host, int(port), world_size=None, is_master=True, wait_for_workers=False)
    PrefixStore(f"dynaplane-preflight/{order.preflight_id}", server).set("joined/a", "1")
    reports = {}
    waiting = threading.Thread(target=lambda: reports.__setitem__("b", run_preflight(order, "b")))
    began = time.monotonic()
    waiting.start()
    time.sleep(1.5)  # b has joined and waits for c
    del server  # the first node's store goes away
    waiting.join(60)
    assert "b" in reports, "b's pre-flight raised instead of reporting"
    assert _checks(reports["b"])["rendezvous"] == (False, f"c did not join the rendezvous {order.rendezvous} within 30 s")
    assert time.monotonic() - began < 20  # it did not wait out its whole deadline on a store that is gone


def test_a_taken_port_fails_on_the_first_node_and_the_others_cannot_reach_it(tmp_path) -> None:
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        order = _order(tmp_path, nodes=("a", "b"), port=port, timeout_seconds=2)
        reports = _together(order, ("a",))
        ok, detail = _checks(reports["a"])["port"]
        assert not ok and detail.startswith(f"port {port} cannot be bound on this host (Address already in use)")
        assert "rendezvous" not in _checks(reports["a"])  # it never served the rendezvous
    alone = run_preflight(_order(tmp_path, nodes=("a", "b"), timeout_seconds=1), "b")
    ok, detail = _checks(alone)["rendezvous"]
    assert not ok and "cannot reach a's rendezvous 127.0.0.1:" in detail and "(Connection refused)" in detail


def test_missing_data_and_an_unwritable_folder_are_named(tmp_path) -> None:
    (tmp_path / "a-file").write_text("not a folder")  # (root writes anywhere, but not under a file)
    report = run_preflight(_order(tmp_path, nodes=("a",), checkpoint_dir=str(tmp_path / "a-file" / "j"),
                                  read_dirs=(str(tmp_path / "no-such-dataset"),)), "a")
    checks = _checks(report)
    assert checks["storage"] == (False, f"cannot write into {tmp_path / 'a-file' / 'j'}: Not a directory")
    assert checks["data"] == (False, f"{tmp_path / 'no-such-dataset'} is not a folder on this host (the data, weights "
                                     f"and checkpoint roots must be storage every host mounts at the same path)")
    assert "rendezvous" not in checks and not report.ok  # one node: nothing to meet


_NODE = """
import json, sys
from agents import protocol
from agents.node.preflight import run_preflight
order = protocol.PreflightOrder.model_validate_json(sys.argv[1])
print(json.dumps(run_preflight(order, sys.argv[2]).model_dump(mode="json")))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a mount namespace of its own needs root and unshare(1)")
def test_a_checkpoint_folder_on_storage_of_its_own_fails_shared_storage(tmp_path) -> None:
    order = _order(tmp_path, nodes=("a", "b"), timeout_seconds=20)
    Path(order.checkpoint_dir).mkdir(parents=True)
    # Node b sees a tmpfs of its own at the checkpoint root's path: a host that does not mount it.
    script = (f"mount -t tmpfs none {tmp_path / 'ckpt'} && exec {sys.executable} -c '{_NODE}' "
              f"'{order.model_dump_json()}' b")
    other = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[3])
    mine = run_preflight(order, "a")
    out, err = other.communicate(timeout=60)
    assert other.returncode == 0, err[-2000:]
    theirs = protocol.PreflightReport.model_validate(json.loads(out.strip().splitlines()[-1]))
    assert mine.ok, mine  # a's own checks pass; it is b that does not see a's probe
    ok, detail = _checks(theirs)["shared storage"]
    assert not ok and detail.startswith(f"{probe_path(order.checkpoint_dir, 7)}, written by a, is not here: "
                                        f"{order.checkpoint_dir} is other storage on this host than on a")
    assert _checks(theirs)["all-reduce"][0] and _checks(theirs)["storage"][0]
