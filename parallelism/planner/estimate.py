"""Time of a plan from a bandwidth model: per round, the slowest rank's same-node and
cross-node bytes over their links plus a per-message latency."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Network:
    """Per-GPU links. Defaults: H100-class NVLink within a node, one 200 Gb/s NIC per GPU."""

    intra_gbytes_per_s: float = 150.0
    inter_gbytes_per_s: float = 25.0
    latency_s: float = 20e-6


def estimate_seconds(stats, network: Network) -> tuple[float, list[float]]:
    """Total and per-round seconds; send and receive directions are full duplex."""
    intra, inter = network.intra_gbytes_per_s * 1e9, network.inter_gbytes_per_s * 1e9
    send = stats.send_intra / intra + stats.send_inter / inter
    recv = stats.recv_intra / intra + stats.recv_inter / inter
    per_round = np.maximum(send, recv).max(axis=1, initial=0.0) + network.latency_s * stats.messages.max(axis=1, initial=0.0)
    return float(per_round.sum()), [float(x) for x in per_round]
