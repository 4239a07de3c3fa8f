"""The device-to-rank map (parallelism/planner/rank_map.py) against brute force: on small cases
every block map (and, for the floor, every bijection of ranks onto processes) is planned
and its bytes counted by the planner itself."""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.planner.plan import PlanOptions, plan_routes
from parallelism.planner.rank_map import savings
from parallelism.layout.tensors import STATE_BYTES
from tests.parallelism.planner.plan_oracle import simulate
from tests.parallelism.layout.strategies import layouts, models

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAPPED = PlanOptions(gpus_per_node=4, staging_bytes=1 << 30, map_ranks=True)
KEPT = PlanOptions(gpus_per_node=4, staging_bytes=1 << 30)


def _network(model, src, dst, process_of) -> int:
    return plan_routes(model, src, dst, KEPT, process_of=process_of).summary()["network_bytes"]


def _block_maps(n_dst: int, n_proc: int, block: int):
    """Every map of destination blocks onto distinct process blocks, slot j on process j,
    that keeps block 0 on process block 0 (rank 0 never changes process)."""
    slot = np.arange(n_dst * block) % block
    for rest in itertools.permutations(range(1, n_proc), n_dst - 1):
        yield np.asarray((0, *rest))[np.arange(n_dst * block) // block] * block + slot


@st.composite
def small_switches(draw, max_world: int = 8):
    model = draw(models(kind=draw(st.sampled_from(["dense", "moe"]))))
    return model, draw(layouts(model, max_world)), draw(layouts(model, max_world))


@SETTINGS
@given(small_switches())
def test_the_chosen_map_moves_the_least_of_every_block_map_and_the_floor_holds(case) -> None:
    model, src, dst = case
    s_p, d_p = place(model, src), place(model, dst)
    weights = savings(model, s_p, d_p)
    n_dst, n_proc = weights.saved.shape
    assume(len(list(itertools.islice(itertools.permutations(range(n_proc), n_dst), 25))) <= 24)
    best = min(_network(model, src, dst, m) for m in _block_maps(n_dst, n_proc, weights.block))
    plan = plan_routes(model, src, dst, MAPPED)
    summary = plan.summary()
    assert summary["network_bytes"] == best
    assert summary["min_network_bytes"] <= best
    assert summary["contract_order_network_bytes"] == _network(model, src, dst, None) >= best
    assert plan.dst_rank(0) == 0
    simulate(plan)  # the mapped plan still writes every destination element once, with the right value


@SETTINGS
@given(small_switches(max_world=4))
def test_no_bijection_of_ranks_onto_processes_moves_less_than_the_floor(case) -> None:
    model, src, dst = case
    s_p, d_p = place(model, src), place(model, dst)
    union = max(s_p.world, d_p.world)
    assume(union <= 4)
    floor = plan_routes(model, src, dst, MAPPED).summary()["min_network_bytes"]
    least = min(_network(model, src, dst, np.asarray(m))
                for m in itertools.permutations(range(union), d_p.world))
    assert 0 <= floor <= least


@SETTINGS
@given(small_switches(), st.randoms(use_true_random=False))
def test_the_weights_count_exactly_what_a_block_map_moves(case, rng) -> None:
    model, src, dst = case
    weights = savings(model, place(model, src), place(model, dst))
    n_dst, n_proc = weights.saved.shape
    blocks = np.asarray(rng.sample(range(n_proc), n_dst))
    process_of = blocks[np.arange(n_dst * weights.block) // weights.block] * weights.block \
        + np.arange(n_dst * weights.block) % weights.block
    assert weights.network_of(process_of) == _network(model, src, dst, process_of)


@SETTINGS
@given(st.data())
def test_identical_layouts_move_nothing_and_keep_every_rank(data) -> None:
    model = data.draw(models())
    layout = data.draw(layouts(model))
    summary = plan_routes(model, layout, layout, MAPPED).summary()
    assert (summary["network_bytes"], summary["min_network_bytes"], summary["ranks_renumbered"]) == (0, 0, 0)


def test_a_dp_shrink_keeps_every_gpus_stage_and_tp_rank() -> None:
    # tiny-gpt tp=2,pp=2,dp=3 -> dp=2: in the contract's order ranks 4-7 change stage.
    model = get_model("tiny-gpt")
    plan = plan_routes(model, "tp=2,pp=2,dp=3,zero=1", "tp=2,pp=2,dp=2,zero=1", MAPPED)
    src, dst = plan.src, plan.dst
    for process in range(src.world):
        rank = plan.dst_rank(process)
        if rank is None:
            continue
        (old,), (new,) = src.modules.values(), dst.modules.values()
        old_stage, new_stage = process // (old.tp * old.dp), rank // (new.tp * new.dp)
        assert (old_stage, process % old.tp) == (new_stage, rank % new.tp)
    summary = plan.summary()
    assert summary["network_bytes"] < summary["contract_order_network_bytes"]
    # Replicated bf16 params never move: only optimizer shards (dp=3 -> dp=2) do.
    optimizer = 12 * model.param_count
    assert summary["network_bytes"] <= optimizer


def test_a_map_that_is_not_a_bijection_is_refused() -> None:
    model = get_model("tiny-gpt")
    try:
        plan_routes(model, "dp=2", "dp=2", KEPT, process_of=np.array([1, 1]))
    except ValueError as exc:
        assert "its own process" in str(exc)
    else:
        raise AssertionError("a map giving two ranks one process was accepted")


def test_llama3_405b_dp64_to_dp48_moves_less_than_its_optimizer_state() -> None:
    """Issue 9's case: 38.0 TB in the contract's order; a checkpoint is 10.6 TiB and the
    whole optimizer state 4.87 TB. The map keeps every GPU's stage and TP rank."""
    model = get_model("llama3-405b")
    summary = plan_routes(model, "tp=8,pp=16,dp=64,zero=1", "tp=8,pp=16,dp=48,zero=1",
                          PlanOptions(map_ranks=True)).summary()
    optimizer = model.param_count * (STATE_BYTES["master"] + STATE_BYTES["exp_avg"] + STATE_BYTES["exp_avg_sq"])
    assert summary["network_bytes"] <= optimizer
    assert summary["min_network_bytes"] <= summary["network_bytes"]
    assert summary["contract_order_network_bytes"] > 7 * optimizer


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_switches())
def test_the_sparse_fallback_gives_the_dense_paths_weights(case) -> None:
    """Matrices too big to hold densely go through the sort-based merge: same weights."""
    from parallelism.planner import rank_map

    model, src, dst = case
    s_p, d_p = place(model, src), place(model, dst)
    dense = savings(model, s_p, d_p)
    saved_max = rank_map._Spared.DENSE_MAX
    rank_map._Spared.DENSE_MAX = 0
    try:
        sparse = savings(model, s_p, d_p)
    finally:
        rank_map._Spared.DENSE_MAX = saved_max
    assert (sparse.need, sparse.best, sparse.fixed) == (dense.need, dense.best, dense.fixed)
    assert np.array_equal(sparse.saved, dense.saved)
