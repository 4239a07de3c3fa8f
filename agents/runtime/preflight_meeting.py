"""The joint part of a pre-flight (agents/node/preflight.py, docs/hosts.md "Pre-flight"): the
nodes meet at the rendezvous (a TCPStore the first node serves, at the address and port rank 0
will serve), sum a tensor over gloo on the interface the ranks use, and check that the first
node's probe file is on every node's checkpoint storage. The first node's store closes when
meet() returns, before the agent reports, so rank 0 can bind the port next.
"""
from __future__ import annotations

import os
import secrets
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from agents import protocol

PROBE_PREFIX = ".dynaplane-preflight-"
CONNECT_RETRY_SECONDS = 0.2

_check = protocol.PreflightCheck.of


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _reach(host: str, port: int, deadline: float) -> str | None:
    """Wait until a TCP connection to host:port succeeds (the first node may not listen yet);
    None, or why it never did."""
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return last
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return None
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        time.sleep(min(CONNECT_RETRY_SECONDS, max(0.0, deadline - time.monotonic())))


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.5, deadline - time.monotonic()))


def _gloo_options(timeout: timedelta) -> ProcessGroupGloo._Options:
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")  # the agent's --interface, as its ranks get it
    options._devices = [ProcessGroupGloo.create_device(interface=interface) if interface
                        else ProcessGroupGloo.create_default_device()]
    return options


def probe_path(folder: str, preflight_id: int) -> Path:
    return Path(folder) / f"{PROBE_PREFIX}{preflight_id}"


def _write_probe(folder: str, preflight_id: int) -> str:
    """The probe file's token ("" when the job has no checkpoint folder or it cannot be written)."""
    if not folder:
        return ""
    token = secrets.token_hex(16)
    try:
        probe_path(folder, preflight_id).write_text(token)
    except OSError:
        return ""
    return token


def shared_storage_check(folder: str, preflight_id: int, token: str, first: str) -> protocol.PreflightCheck:
    if not folder:
        return _check("shared storage", True, "the job writes no checkpoints")
    if not token:
        return _check("shared storage", False, f"{first} could not write its probe into {folder}")
    path = probe_path(folder, preflight_id)
    rule = "the checkpoint root must be one shared storage every host mounts at the same path (DYNAPLANE_CHECKPOINT_ROOT)"
    try:
        found = path.read_text()
    except FileNotFoundError:
        return _check("shared storage", False, f"{path}, written by {first}, is not here: {folder} is other storage "
                                                f"on this host than on {first}; {rule}")
    except OSError as exc:
        return _check("shared storage", False, f"cannot read {path}: {exc.strerror or exc}")
    if found.strip() != token:
        return _check("shared storage", False, f"{path} holds another token than {first} wrote: {folder} is other "
                                                f"storage here; {rule}")
    return _check("shared storage", True, f"read the probe {first} wrote")


def _not_joined(store: PrefixStore, nodes: tuple[str, ...], deadline: float) -> list[str]:
    """The nodes that did not join by `deadline`, each waited for in turn. Once one is missing the
    rest are only looked at; a store that has gone meanwhile (the first node closes it when its own
    wait ends, which may be a moment before this node's) counts them as missing, never raises."""
    missing: list[str] = []
    for name in nodes:
        try:
            if missing:
                joined = store.check([f"joined/{name}"])
            else:
                store.wait([f"joined/{name}"], _left(deadline))
                joined = True
        except Exception:  # torch's DistError kinds: the wait timed out or the store went away
            joined = False
        if not joined:
            missing.append(name)
    return missing


def meet(order: protocol.PreflightOrder, node: str, deadline: float) -> list[protocol.PreflightCheck]:
    """The rendezvous, all-reduce and shared storage checks, with the order's other nodes, all
    done by `deadline` (time.monotonic())."""
    host, port = protocol.rendezvous_host_port(order.rendezvous)
    index, n, head = order.nodes.index(node), len(order.nodes), order.nodes[0]
    first = index == 0
    if not first:
        why = _reach(host, port, deadline)
        if why is not None:
            return [_check("rendezvous", False, f"cannot reach {head}'s rendezvous {order.rendezvous} from this "
                                                f"host within {order.timeout_seconds:.0f} s ({why})")]
    try:
        server = TCPStore(host, port, world_size=None, is_master=first, timeout=_left(deadline),
                          wait_for_workers=False)
    except Exception as exc:  # torch raises its own DistError kinds (C++), not OSError
        return [_check("rendezvous", False, f"the store at {order.rendezvous}: {_first_line(exc)}")]
    store = PrefixStore(f"dynaplane-preflight/{order.preflight_id}", server)
    probe = ""
    try:
        store.set(f"joined/{node}", "1")
        if first:
            probe = _write_probe(order.checkpoint_dir, order.preflight_id)
            store.set("probe", probe)
        missing = _not_joined(store, order.nodes, deadline)
        if missing:
            return [_check("rendezvous", False, f"{', '.join(missing)} did not join the rendezvous "
                                                f"{order.rendezvous} within {order.timeout_seconds:.0f} s")]
        out = [_check("rendezvous", True, f"{n} nodes met at {order.rendezvous}")]
        try:
            group = ProcessGroupGloo(PrefixStore("gloo", store), index, n, _gloo_options(_left(deadline)))
            total = torch.ones(1)
            began = time.perf_counter()
            group.allreduce([total]).wait()
            took = time.perf_counter() - began
        except Exception as exc:
            return out + [_check("all-reduce", False, f"gloo over {os.environ.get('GLOO_SOCKET_IFNAME') or 'the default interface'}: "
                                                      f"{_first_line(exc)}")]
        if int(total.item()) != n:
            return out + [_check("all-reduce", False, f"the sum over {n} nodes was {total.item()}, not {n}")]
        out.append(_check("all-reduce", True, f"{n} nodes summed over gloo in {took * 1000:.1f} ms"))
        if not first:
            out.append(shared_storage_check(order.checkpoint_dir, order.preflight_id,
                                            store.get("probe").decode(), head))
        try:  # (the first node removes its probe once every node has read it)
            group.allreduce([torch.ones(1)]).wait()
        except Exception as exc:
            out.append(_check("all-reduce", False, f"the closing all-reduce: {_first_line(exc)}"))
        return out
    finally:
        if first and probe:
            probe_path(order.checkpoint_dir, order.preflight_id).unlink(missing_ok=True)
