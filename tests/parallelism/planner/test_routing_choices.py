"""Replica choice: same node first, otherwise spread evenly (no hot spot on rank 0)."""
from __future__ import annotations

import numpy as np

from parallelism.layout.catalog import get_model
from parallelism.planner.plan import PlanOptions, plan_routes


def _sent_per_rank(plan) -> np.ndarray:
    stats = plan.stats
    return (stats.send_intra + stats.send_inter).sum(axis=0)


def test_growing_dp_spreads_reads_over_all_replicas() -> None:
    plan = plan_routes(get_model("tiny-gpt"), "dp=4", "dp=12", PlanOptions(gpus_per_node=1))
    sent = _sent_per_rank(plan)[:4]
    assert sent.min() > 0
    assert sent.max() / sent.min() < 1.3, sent  # ElasticMegatron would read everything from rank 0


def test_same_node_replica_is_preferred() -> None:
    # Ranks 0-3 hold replicas; ranks 4-7 share node 1 with none of them, ranks 2-3 ... node 0.
    plan = plan_routes(get_model("tiny-gpt"), "dp=2", "dp=8", PlanOptions(gpus_per_node=4))
    transfers = plan.dump()["transfers"]
    to_node0 = [t for t in transfers if t["dst"] in (2, 3)]
    assert to_node0 and all(t["src"] in (0, 1) for t in to_node0)
    stats = plan.stats
    # Only node 1 (no replica there) receives over the network.
    assert stats.recv_inter.sum(axis=0)[:4].sum() == 0 and stats.recv_inter.sum(axis=0)[4:].sum() > 0


def test_what_a_rank_holds_is_never_sent_to_it() -> None:
    plan = plan_routes(get_model("llama3-8b"), "tp=8,dp=2,zero=1", "tp=8,dp=3,zero=1")
    summary = plan.summary()
    assert summary["network_bytes"] == summary["state_bytes_dst"] - summary["local_bytes"] - summary["derived_bytes"]
    assert summary["min_network_bytes"] <= summary["network_bytes"]
    # Ranks 0-15 keep their TP shards of `param` (zero=1 replicates it): only ranks 16-23 receive params.
    assert summary["local_bytes"] >= 16 * get_model("llama3-8b").param_count * 2 // 8
