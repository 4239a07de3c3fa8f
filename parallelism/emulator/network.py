"""Collective times: alpha-beta models of NCCL's algorithms on intra- and inter-node links.

n = group size, N = nodes the group spans, g = ceil(n / N) ranks on its busiest node,
S = `CommOp.bytes`, B_i / B_e = achievable per-GPU one-direction bandwidth inside a node
(NVLink) / through the GPU's NIC, a_i / a_e = per-hop latencies (DeviceProfile).

- ring: a ring visits every node once per channel, so of the bytes a rank moves a
  fraction (g-1)/g crosses NVLink and 1/g leaves the node, spread over the node's g NICs:
      B_ring = B_i                                   (N = 1)
      B_ring = 1 / max((g-1)/g / B_i, 1/(g B_e))     (N > 1; = B_e when g = 1)
  all_reduce: 2(n-1)/n S / B_ring + latency of 2(n-1) steps
  all_gather (S = output), reduce_scatter (S = input): (n-1)/n S / B_ring + n-1 steps
  broadcast: S / B_ring + n-1 steps (pipelined chain)
  Step latencies as NCCL counts them: steps that cross nodes (2(N-1) for all_reduce,
  N-1 otherwise) pay a_e, the rest a_i.
- tree (all_reduce only; NCCL's double binary tree, chain inside a node):
      2 ((g-1) a_i + ceil(log2 N) a_e) + 2 S / B_ring
- all_to_all: pairwise exchange, n-1 rounds of S/n each with one peer:
      (g-1) (a_i + S/(n B_i)) + (n-g) (a_e + S/(n B_e))
- send / recv: a + S / B over NVLink when N = 1, else over the NIC.

A calibrated profile's measured table (DeviceProfile.collective_table) replaces these
models for the kinds and group sizes it holds, inside one node.

Algorithm choice for all_reduce as NCCL's tuner does it (src/graph/tuning.cc): the one
with the smaller predicted time, ring on a tie. So tree wins for small, latency-bound
messages on groups that span several nodes, ring for large messages (and always within
one node, where the tree degenerates to a chain with the ring's latency).
"""
from __future__ import annotations

import math

from parallelism.emulator.devices import DeviceProfile
from parallelism.emulator.errors import require
from parallelism.emulator.trace import CommOp


def ranks_per_node(op: CommOp, gpus_per_node: int) -> int:
    require(isinstance(gpus_per_node, int) and gpus_per_node >= 1,
            f"gpus_per_node={gpus_per_node!r} must be a positive integer")
    g = math.ceil(op.group_size / op.nodes)
    require(g <= gpus_per_node, f"comm op {op.name!r}: {op.group_size} ranks over {op.nodes} nodes puts {g} "
                                f"on a node, more than gpus_per_node={gpus_per_node}")
    return g


def ring_bandwidth(group_size: int, nodes: int, profile: DeviceProfile) -> float:
    """Per-rank bytes/s of a ring over `group_size` ranks on `nodes` nodes."""
    if nodes == 1:
        return profile.intra_bw
    g = math.ceil(group_size / nodes)
    return 1.0 / max((g - 1) / g / profile.intra_bw, 1.0 / (g * profile.inter_bw))


def _step_latency(steps: int, inter_steps: int, profile: DeviceProfile) -> float:
    return (steps - inter_steps) * profile.intra_node_latency + inter_steps * profile.inter_node_latency


def ring_seconds(op: CommOp, profile: DeviceProfile) -> float:
    n, N, S = op.group_size, op.nodes, op.bytes
    bw = ring_bandwidth(n, N, profile)
    if op.kind == "all_reduce":
        return 2 * (n - 1) / n * S / bw + _step_latency(2 * (n - 1), 2 * (N - 1), profile)
    if op.kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * S / bw + _step_latency(n - 1, N - 1, profile)
    if op.kind == "broadcast":
        return S / bw + _step_latency(n - 1, N - 1, profile)
    raise ValueError(f"no ring algorithm for {op.kind}")


def tree_seconds(op: CommOp, profile: DeviceProfile) -> float:
    n, N, S = op.group_size, op.nodes, op.bytes
    g = math.ceil(n / N)
    latency = 2 * ((g - 1) * profile.intra_node_latency + math.ceil(math.log2(N)) * profile.inter_node_latency)
    return latency + 2 * S / ring_bandwidth(n, N, profile)


def all_to_all_seconds(op: CommOp, profile: DeviceProfile) -> float:
    n, N, S = op.group_size, op.nodes, op.bytes
    g = math.ceil(n / N)
    chunk = S / n
    return ((g - 1) * (profile.intra_node_latency + chunk / profile.intra_bw)
            + (n - g) * (profile.inter_node_latency + chunk / profile.inter_bw))


def p2p_seconds(op: CommOp, profile: DeviceProfile) -> float:
    if op.nodes == 1:
        return profile.intra_node_latency + op.bytes / profile.intra_bw
    return profile.inter_node_latency + op.bytes / profile.inter_bw


def collective_algorithm(op: CommOp, profile: DeviceProfile, gpus_per_node: int = 8) -> str:
    """"none" (one rank), "ring", "tree", "pairwise" or "p2p"."""
    ranks_per_node(op, gpus_per_node)
    if op.group_size == 1 and op.kind not in ("send", "recv"):
        return "none"
    if op.kind in ("send", "recv"):
        return "p2p"
    if op.kind == "all_to_all":
        return "pairwise"
    if op.kind == "all_reduce" and tree_seconds(op, profile) < ring_seconds(op, profile):
        return "tree"
    return "ring"


def measured_seconds(op: CommOp, profile: DeviceProfile) -> float | None:
    """The profile's measured time for this collective (calibrated profiles; one node only):
    piecewise linear in log(size) between measured sizes, below the smallest its time, above
    the largest its time plus the extra bytes at the rate of the two largest points."""
    points = profile.collective_table.get(op.kind, {}).get(str(op.group_size)) if op.nodes == 1 else None
    if not points:
        return None
    sizes = [p[0] for p in points]
    S = op.bytes
    if S <= sizes[0]:
        return points[0][1]
    if S >= sizes[-1]:
        (s0, t0), (s1, t1) = points[-2], points[-1]
        return t1 + (S - s1) * max(t1 - t0, 0.0) / (s1 - s0)
    i = next(i for i, s in enumerate(sizes) if s >= S)
    (s0, t0), (s1, t1) = points[i - 1], points[i]
    w = (math.log(S) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return t0 + w * (t1 - t0)


def collective_seconds(op: CommOp, profile: DeviceProfile, gpus_per_node: int = 8) -> float:
    """Seconds one rank spends in `op` (all ranks of a symmetric collective take as long)."""
    algorithm = collective_algorithm(op, profile, gpus_per_node)
    if algorithm == "none":
        return 0.0
    measured = measured_seconds(op, profile)
    if measured is not None:
        return measured
    if algorithm == "p2p":
        return p2p_seconds(op, profile)
    if algorithm == "pairwise":
        return all_to_all_seconds(op, profile)
    if algorithm == "tree":
        return tree_seconds(op, profile)
    return ring_seconds(op, profile)
