"""A node's part of a pre-flight (issue 44, docs/hosts.md "Pre-flight"): before a job starts on,
or grows onto, more than one host, every node involved checks what its ranks will need, and
the nodes check it together:

- storage: the job's checkpoint folder can be written here;
- data: the folders its ranks read (dataset, initial weights, the checkpoint a resume loads) are
  here and readable;
- port (the first node, which will run rank 0): the rendezvous port is free on this host;
- rendezvous: every node reaches the first one's TCPStore at the job's rendezvous address;
- all-reduce: the nodes sum a tensor over gloo, on the interface the ranks will use
  (GLOO_SOCKET_IFNAME), so every pair of hosts connects as the ranks' collectives will;
- shared storage: the first node writes a probe file with a random token into the checkpoint
  folder and puts the token in the store; every other node reads the file and finds the token
  (a folder of the same name on storage of its own has no such file).

A check that cannot run because an earlier one failed is left out of the report. Nothing here
touches a running rank. The joint checks need torch, which the agent's own modules never import:
they are agents/runtime/preflight_meeting.py's, loaded when a pre-flight spans nodes.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time

from agents import protocol


_check = protocol.PreflightCheck.of


def storage_check(folder: str) -> protocol.PreflightCheck:
    """The job's checkpoint folder can be made and written here (a file written, synced, removed)."""
    if not folder:
        return _check("storage", True, "the job writes no checkpoints")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".dynaplane-write-") as probe:
            probe.write(b"ok")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        return _check("storage", False, f"cannot write into {folder}: {exc.strerror or exc}")
    return _check("storage", True, f"{folder} is writable")


def data_check(folders: tuple[str, ...]) -> protocol.PreflightCheck:
    """Every folder the ranks read is here and can be listed."""
    for folder in folders:
        if not os.path.isdir(folder):
            return _check("data", False, f"{folder} is not a folder on this host (the data, weights and checkpoint "
                                         f"roots must be storage every host mounts at the same path)")
        try:
            os.listdir(folder)
        except OSError as exc:
            return _check("data", False, f"cannot read {folder}: {exc.strerror or exc}")
    return _check("data", True, f"{len(folders)} folder(s) readable")


def port_check(port: int) -> protocol.PreflightCheck:
    """Rank 0's store can listen on `port` here: a bind on every interface succeeds (with
    SO_REUSEADDR, as torch's store binds, so connections closing do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
            probe.listen(1)
        except OSError as exc:
            return _check("port", False, f"port {port} cannot be bound on this host ({exc.strerror or exc}): another "
                                         f"process holds it; free it or narrow DYNAPLANE_RENDEZVOUS_PORTS")
    return _check("port", True, f"port {port} is free")


def run_preflight(order: protocol.PreflightOrder, node: str) -> protocol.PreflightReport:
    """This node's checks, the joint ones with the order's other nodes; never raises for a
    failed check (it is reported). ValueError when `node` is not one of the order's."""
    if node not in order.nodes:
        raise ValueError(f"node {node} is not in the pre-flight's nodes {list(order.nodes)}")
    started = time.monotonic()
    deadline = started + order.timeout_seconds
    first = order.nodes[0] == node
    checks = [storage_check(order.checkpoint_dir)]
    if order.read_dirs:
        checks.append(data_check(order.read_dirs))
    serve = True
    if first:
        checks.append(port_check(protocol.rendezvous_host_port(order.rendezvous)[1]))
        serve = checks[-1].ok
    if len(order.nodes) > 1 and serve:
        from agents.runtime.preflight_meeting import meet  # (torch: only an agent that meets others loads it)

        checks += meet(order, node, deadline)
    return protocol.PreflightReport(preflight_id=order.preflight_id, job_id=order.job_id, node=node,
                                    checks=tuple(checks), seconds=round(time.monotonic() - started, 3))
