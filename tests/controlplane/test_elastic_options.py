"""The elastic scheduler's size options come from the resize proposals' ranking."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from parallelism.layout.catalog import get_model
from controlplane.jobs.elastic_options import candidate_sizes, size_options
from controlplane.jobs.proposals import propose


@given(st.integers(1, 40), st.integers(0, 60), st.sampled_from([1, 2, 4, 8]))
def test_candidate_sizes_are_every_count_up_to_a_node_then_whole_nodes(lo, extra, per_node) -> None:
    sizes = candidate_sizes(lo, lo + extra, per_node)
    assert sizes == sorted(set(sizes))
    assert all(lo <= n <= lo + extra for n in sizes)
    assert set(range(lo, min(lo + extra, per_node) + 1)) <= set(sizes)
    assert all(n % per_node == 0 for n in sizes if n > per_node)


def test_each_option_is_the_top_ranked_layout_that_fits() -> None:
    model = get_model("llama3-8b")
    kwargs = dict(layout="dp=8,zero=1", global_batch=48, micro_batch=1, seq_len=4096, step_seconds=4.0,
                  capacity_bytes=80 * 2**30)
    options = size_options(model, sizes=[1, 2, 10, 16], **kwargs)
    assert [o.gpus for o in options] == [2, 10, 16]  # 1: 112 GB of state fits no 80 GiB GPU
    assert (options[1].layout, options[1].block) == ("tp=2,pp=5,zero=1", 2)
    for option in options:
        top = next(p for p in propose(model, current_layout=kwargs["layout"], gpus=option.gpus,
                                      **{k: v for k, v in kwargs.items() if k != "layout"}) if p.fits)
        assert (option.layout, option.step_seconds, option.block, option.state_bytes_per_gpu) == \
            (top.layout, top.step_seconds, top.tp, top.state_bytes_per_gpu)
    assert options[-1].step_seconds == 2.0  # the measured 4 s on 8 GPUs, scaled by work per GPU
