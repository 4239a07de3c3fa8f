"""The memory wave (issue 3): what is guaranteed on every rank, why whole boxes cannot
promise max(source, destination) + staging, and the measured cases it is held to."""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given

from parallelism.layout.catalog import get_model
from parallelism.planner.plan import PlanOptions, RoutingPlan, plan_routes
from parallelism.layout.tensors import STATE_BYTES, Model, ModuleSpec, TensorSpec, TensorSplit
from tests.parallelism.planner.plan_oracle import local_copies_are_scheduled, simulate
from tests.parallelism.planner.test_plan_properties import SETTINGS, transitions


def one_at_a_time_peak(plan: RoutingPlan) -> np.ndarray:
    """Per rank: the peak if the plan's items moved one at a time in the plan's order, every
    rank allocating an item's new box before freeing its old one (whole boxes; a box the
    same in both layouts is kept). Depends on the layouts and the order only."""
    mem = np.zeros(plan.world)
    for item in plan.items:
        h = item.route.src_holders
        mem[h.rank] += h.size * STATE_BYTES[item.state]
    peak = mem.copy()
    for item in plan.items:
        r, nbytes = item.route, STATE_BYTES[item.state]
        for boxes, sign in ((r.dst_holders, 1.0), (r.src_holders, -1.0)):
            moving = ~np.isin(boxes.rank, r.kept)
            mem[boxes.rank[moving]] += sign * boxes.size[moving] * nbytes
            np.maximum(peak, mem, out=peak)
    return peak


def local_copy_bytes(plan: RoutingPlan) -> np.ndarray:
    """Per rank: the most source bytes it copies locally (from a box it does not keep)
    within one round."""
    per_round = np.zeros((len(plan.rounds), plan.world))
    for k, round_slices in enumerate(plan.rounds):
        for i in {sl.item for sl in round_slices if sl.t_lo == 0}:
            item = plan.items[i]
            r = item.route
            ranks = np.unique(np.concatenate([r.copying(sl.a_lo, sl.a_hi) for sl in round_slices
                                              if sl.item == i and sl.t_lo == 0]))
            h = r.src_holders
            per_round[k, ranks] += h.size[np.searchsorted(h.rank, ranks)] * STATE_BYTES[item.state]
    return per_round.max(axis=0, initial=0)


@SETTINGS
@given(transitions())
def test_memory_wave_stays_within_the_orders_own_peak_plus_staging(case) -> None:
    """Guaranteed on every rank: rounds add at most the staging budget (+ the sources a
    rank copies locally in one round, which the engine frees after allocating the round's
    receiving boxes) to the peak of moving the items one at a time in the plan's order;
    that peak is at most source + destination. Whole boxes make max(source, destination)
    + staging unreachable in general (test below), so that is measured, not asserted."""
    model, src, dst, options = case
    plan = plan_routes(model, src, dst, options)
    after, peak = plan.waves
    rank_peak = peak.max(axis=0, initial=0)
    sequential = one_at_a_time_peak(plan)
    assert (rank_peak <= sequential + options.staging_bytes + local_copy_bytes(plan)).all()
    assert (sequential <= after[0] + after[-1]).all()
    summary = plan.summary()
    assert 0 <= summary["ranks_over_box_bound"] <= summary["ranks_over_memory_bound"] <= plan.world


def _swap(box_rows: int, staging: int) -> RoutingPlan:
    """Two ranks trading their whole state: rank 0 holds the encoder and needs the llm,
    rank 1 the other way round; every box is `box_rows` rows of 16 elements."""
    def tensor(module: str) -> TensorSpec:
        return TensorSpec(f"{module}.layers.0.w.weight", (box_rows, 16), TensorSplit(module, 0, None, None, None, None))

    model = Model("swap", "multimodal", (ModuleSpec("encoder", 1, 1, 1), ModuleSpec("llm", 1, 1, 1)),
                  (tensor("encoder"), tensor("llm")))
    return plan_routes(model, "encoder:ranks=0-0;llm:ranks=1-1", "encoder:ranks=1-1;llm:ranks=0-0",
                       PlanOptions(staging_bytes=staging, gpus_per_node=1))


def _best_whole_box_excess(box: int, staging: int) -> int:
    """Brute force over every order of the four events of a two-rank swap of one box each
    (q allocates X, r frees X, r allocates Y, q frees Y): the least, over orders, of the
    most any rank holds above max(source, destination). A source may be freed before its
    copy is allocated only while the copy fits in staging (box <= staging), and then the
    bytes in flight count."""
    events = [("alloc", "q", "X"), ("free", "r", "X"), ("alloc", "r", "Y"), ("free", "q", "Y")]
    best = None
    for order in itertools.permutations(events):
        held = {"q": box, "r": box}  # each holds its source box; max(source, destination) = box
        in_flight, worst = {"q": 0, "r": 0}, 0
        for op, rank, name in order:
            if op == "free":
                receiver = "q" if rank == "r" else "r"
                allocated = order.index(("alloc", receiver, name)) < order.index((op, rank, name))
                if not allocated:
                    if box > staging:
                        break  # the receiver has nowhere to put a box larger than staging
                    in_flight[receiver] += box
                held[rank] -= box
            else:
                sender = "q" if rank == "r" else "r"
                if order.index(("free", sender, name)) < order.index((op, rank, name)):
                    in_flight[rank] -= box  # it lands from staging
                held[rank] += box
            worst = max(worst, *(held[x] + in_flight[x] - box for x in held))
        else:
            best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def test_whole_boxes_larger_than_staging_cannot_stay_within_max_plus_staging() -> None:
    """Two ranks swapping boxes: the receiver must allocate a box larger than staging before
    the sender may free it, so one rank holds both: at least one box above max(source,
    destination), more than the staging budget. With boxes that fit in staging the same
    swap costs no more than the staging."""
    assert _best_whole_box_excess(box=2048, staging=1024) == 2048 > 1024
    assert _best_whole_box_excess(box=512, staging=1024) <= 1024
    plan = _swap(box_rows=64, staging=1024)  # fp32 boxes of 4096 B, bf16 param 2048 B
    simulate(plan)
    after, peak = plan.waves
    bound = np.maximum(after[0], after[-1]) + plan.options.staging_bytes
    rank_peak = peak.max(axis=0)
    assert (rank_peak > bound).any()  # unavoidable, by the argument above
    assert (rank_peak <= bound + plan.largest_boxes).all()
    summary = plan.summary()
    assert summary["ranks_over_memory_bound"] >= 1 and summary["ranks_over_box_bound"] == 0


def test_the_same_swap_within_the_budget_stays_within_max_plus_staging() -> None:
    plan = _swap(box_rows=4, staging=1024)
    after, peak = plan.waves
    assert (peak.max(axis=0) <= np.maximum(after[0], after[-1]) + 1024).all()


def test_rows_with_only_local_copies_get_a_slice() -> None:
    """An item cut into row slices for its transfers: rows that only a local copy needs
    still get a slice, or the engine would leave them unwritten."""
    w = TensorSpec("llm.layers.0.w.weight", (8, 64), TensorSplit("llm", 0, None, 0, None, None))
    model = Model("rows", "llama", (ModuleSpec("llm", 1, 2, 2),), (w,))
    plan = plan_routes(model, "dp=1", "tp=2", PlanOptions(staging_bytes=600, gpus_per_node=1))
    local_copies_are_scheduled(plan)
    simulate(plan)


def test_a_pipeline_change_stays_within_max_source_destination_plus_staging() -> None:
    """The issue's measured worst case (1.198x with layers ordered by stage position):
    kind-first order keeps every rank within max(source, destination) + staging."""
    plan = plan_routes(get_model("llama3-405b"), "tp=8,pp=16,dp=1,zero=1", "tp=8,pp=12,dp=1,zero=1")
    assert plan.summary()["ranks_over_memory_bound"] == 0
