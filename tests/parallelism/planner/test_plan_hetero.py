"""The state planner on switches of multimodal models between homogeneous, colocated and
non-colocated layouts (issue 8): each module's tensors are boxed under that module's layout
and ranks, and the plan writes every destination element exactly once from a holder of it."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import place
from parallelism.planner.plan import PlanOptions, plan_routes
from tests.parallelism.planner.plan_oracle import simulate
from tests.parallelism.layout.strategies import layouts, models, module_layouts


@st.composite
def multimodal_layout(draw, model, kind: str) -> str:
    if kind == "homogeneous":  # one plain layout for both modules
        text = draw(module_layouts(model.modules[1], 8)).to_string(False)
        try:
            place(model, text)
        except LayoutError:  # e.g. tp does not divide the encoder's heads
            assume(False)
        return text
    for _ in range(10):
        text = draw(layouts(model, 8))
        if place(model, text).layout.is_heterogeneous and (
                any(m.first_rank is not None for m in place(model, text).layout.modules) == (kind == "non-colocated")):
            return text
    assume(False)


@st.composite
def switches(draw):
    model = draw(models("multimodal"))
    kinds = ["homogeneous", "colocated", "non-colocated"]
    src_kind, dst_kind = draw(st.sampled_from(kinds)), draw(st.sampled_from(kinds))
    return (model, draw(multimodal_layout(model, src_kind)), draw(multimodal_layout(model, dst_kind)),
            PlanOptions(gpus_per_node=draw(st.sampled_from([1, 2, 8])), staging_bytes=draw(st.sampled_from([512, 1 << 30]))))


def _check_module_boxes(model, layout: str, shards: list[dict]) -> None:
    """Every element of every module's tensor state is held, equally often (replicas), and
    only by ranks of that module's placement."""
    placement = place(model, layout)
    by_key: dict[tuple[str, str], list[dict]] = {}
    for row in shards:
        by_key.setdefault((row["tensor"], row["state"]), []).append(row)
    for tensor in model.tensors:
        ml = placement.modules[tensor.split.module]
        for state in ("param", "master", "exp_avg", "exp_avg_sq"):
            rows = by_key.get((tensor.name, state), [])
            count = np.zeros(tensor.shape, dtype=np.int64)
            for row in rows:
                assert ml.offset <= row["rank"] < ml.offset + ml.world, (layout, tensor.name, state, row["rank"])
                count[tuple(slice(o, o + n) for o, n in zip(row["offsets"], row["lengths"]))] += 1
            assert count.min() >= 1 and count.min() == count.max(), (layout, tensor.name, state,
                                                                     np.unique(count))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(switches())
def test_hetero_and_homogeneous_switches_write_every_module_element_once(case) -> None:
    model, src, dst, options = case
    plan = plan_routes(model, src, dst, options)
    dump = plan.dump()
    _check_module_boxes(model, src, dump["src"]["shards"])
    _check_module_boxes(model, dst, dump["dst"]["shards"])
    simulate(plan)  # each destination element written exactly once, with its value, from a holder
    summary = plan.summary()
    assert summary["network_bytes"] == summary["state_bytes_dst"] - summary["local_bytes"] - summary["derived_bytes"]
    assert summary["min_network_bytes"] <= summary["network_bytes"]
