"""MoE layers with tensor and expert parallelism (issue 29) on tiny-moe (8 experts, top-2,
layer 0 dense), on real gloo process groups.

Under tp each expert's FFN dimension is split (gate/up on dim 1, down on dim 2) and the
router replicated; under ep the experts are split over ep consecutive data-parallel ranks
and the tokens go to their experts' owners with all-to-all. The oracle is a single-rank
run routed as the parallel run routed (tests/support/moe_routes.py: bf16 layout noise flips
near-tied top-k choices): after one step every rank's Adam first moment, the experts' and
the router's included, must equal the same box of the single-rank gradient. Leaving out the
router's sum over tp, or averaging the experts' gradients over their replicas instead of
over dp, puts those boxes off by O(1). Then online switches dp=4,ep=4 <-> tp=2,dp=2,ep=2,
into and out of dp=4 (no ep) and ZeRO-3, bit-exact against the checkpoint path, verified,
with training going on as an unswitched run does.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism.layout.catalog import get_model
from parallelism.training.expert_parallel import expert_major
from parallelism.training.moe import balanced_counts
from parallelism.training.parallel import TrainConfig
from parallelism.training.run import Switch
from tests.support.switched_training import check_switched_training
from tests.support.moe_routes import moe_boxes_off_the_single_rank

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIG = TrainConfig(model="tiny-moe", global_batch=8, seq_len=16, micro_batches=2, lr=3e-3)
START = "dp=4,ep=4,zero=1"
SWITCHES = [Switch(2, "tp=2,dp=2,ep=2,zero=1"), Switch(4, "dp=4,zero=1"), Switch(6, "tp=2,dp=2,ep=2,zero=3"),
            Switch(8, START)]
STEPS = 10
TOKENS = 3 * CONFIG.global_batch * CONFIG.seq_len  # three MoE layers route every token of the batch


def test_tiny_moe_has_experts_ep_and_tp_split() -> None:
    spec = get_model(CONFIG.model)
    assert spec.module("llm").num_experts == 8
    names = {t.name for t in spec.tensors}
    assert "llm.layers.0.mlp.gate.weight" in names and "llm.layers.1.moe.router.weight" in names
    experts = [t for t in spec.tensors if ".moe.experts." in t.name]
    assert len(experts) == 9 and all(t.split.ep_dim == 0 for t in experts)


@pytest.mark.parametrize("layout,world,sequence_parallel", [
    ("tp=2,zero=0", 2, False), ("tp=2,dp=2,zero=3", 4, False), ("tp=2,pp=2,zero=1", 4, False),
    ("tp=2,zero=1", 2, True),
    ("dp=2,ep=2,zero=0", 2, False), ("dp=4,ep=4,zero=1", 4, False), ("dp=4,ep=2,zero=1", 4, False),
    ("dp=4,ep=2,zero=3", 4, False), ("dp=4,ep=4,zero=3", 4, False), ("tp=2,dp=2,ep=2,zero=1", 4, False),
    ("tp=2,dp=2,ep=2,zero=3", 4, False), ("tp=2,dp=2,ep=2,zero=1", 4, True), ("pp=2,dp=2,ep=2,zero=1", 4, False),
])
def test_gradients_match_a_single_rank_routed_alike(layout: str, world: int, sequence_parallel: bool) -> None:
    config = replace(CONFIG, sequence_parallel=sequence_parallel)
    off, checked, routes = moe_boxes_off_the_single_rank(config, layout, world)
    assert off == []
    assert routes == TOKENS
    assert set(checked) == set(range(len(get_model(CONFIG.model).tensors)))  # every tensor, every expert


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda sources: st.integers(1, 4).flatmap(
    lambda experts: st.lists(st.lists(st.integers(0, 5), min_size=experts, max_size=experts),
                             min_size=sources, max_size=sources))))
def test_received_rows_are_regrouped_expert_by_expert(counts) -> None:
    """Brute force: label every received row (source, expert, i) in arrival order; the
    regrouped order is those labels sorted by (expert, source, i)."""
    labels = [(s, e, i) for s, row in enumerate(counts) for e, n in enumerate(row) for i in range(n)]
    order = expert_major(counts)
    assert sorted(order) == list(range(len(labels)))
    assert [labels[i] for i in order] == sorted(labels, key=lambda x: (x[1], x[0], x[2]))


@given(st.integers(0, 10_000), st.integers(1, 256))
def test_balanced_counts_spread_the_assignments_evenly(n: int, experts: int) -> None:
    counts = balanced_counts(n, experts)
    assert len(counts) == experts and sum(counts) == n and max(counts) - min(counts) <= 1


def _expert_params(spec, shards) -> dict:
    return {(spec.tensors[i].name, state): s.data for (i, state), s in shards.items()
            if ".moe.experts." in spec.tensors[i].name and state == "param"}


def test_switches_into_and_out_of_expert_parallelism_are_exact_verified_and_train_on(tmp_path) -> None:
    switched = check_switched_training(CONFIG, START, SWITCHES, STEPS, str(tmp_path), final=_expert_params)
    # Back at dp=4,ep=4: each rank holds 2 of the 8 experts of every MoE layer.
    assert all(len(r["final"]) == 9 and all(v.shape[0] == 2 for v in r["final"].values()) for r in switched)
    assert all(torch.isfinite(torch.tensor(switched[0]["losses"])))
