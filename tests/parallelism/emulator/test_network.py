"""Collective time models."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from parallelism.emulator.devices import get_profile
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.network import collective_algorithm, collective_seconds, measured_seconds, ring_bandwidth
from parallelism.emulator.trace import CommOp

H100 = get_profile("h100")
A100 = get_profile("a100")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 8), size=st.floats(1e6, 1e10), device=st.sampled_from(["a100", "h100", "h200", "b200"]))
def test_ring_all_reduce_is_textbook_within_a_node(n, size, device):
    profile = get_profile(device)
    op = CommOp("ar", "all_reduce", size, n, 1, "tp")
    assert collective_algorithm(op, profile) == "ring"
    expected = 2 * (n - 1) / n * size / profile.intra_bw + 2 * (n - 1) * profile.intra_node_latency
    assert collective_seconds(op, profile) == pytest.approx(expected, rel=1e-12)


def test_ring_all_reduce_across_nodes_one_rank_per_node_runs_at_the_nic():
    op = CommOp("grads", "all_reduce", 1e9, 64, 64, "dp")
    expected = 2 * 63 / 64 * 1e9 / H100.inter_bw + 2 * 63 * H100.inter_node_latency
    assert collective_seconds(op, H100) == pytest.approx(expected, rel=1e-12)


def test_ring_spanning_full_nodes_uses_all_their_nics():
    # 8 ranks per node: the node's 8 NICs carry 1/8 of each rank's traffic each
    assert ring_bandwidth(16, 2, H100) == pytest.approx(min(H100.intra_bw * 8 / 7, 8 * H100.inter_bw))
    assert ring_bandwidth(8, 8, H100) == pytest.approx(H100.inter_bw)
    assert ring_bandwidth(8, 1, H100) == pytest.approx(H100.intra_bw)
    # crossing nodes never beats staying inside one
    for g in (1, 2, 4, 8):
        assert ring_bandwidth(4 * g, 4, A100) <= A100.intra_bw * g / max(g - 1, 1) + 1e-6


def test_tree_for_tiny_messages_ring_for_large():
    tiny = CommOp("norm", "all_reduce", 8, 64, 64, "dp")
    large = CommOp("grads", "all_reduce", 2e9, 64, 64, "dp")
    assert collective_algorithm(tiny, H100) == "tree"
    assert collective_algorithm(large, H100) == "ring"
    log = math.ceil(math.log2(64))
    assert collective_seconds(tiny, H100) == pytest.approx(2 * log * H100.inter_node_latency + 2 * 8 / H100.inter_bw)
    # within one node the tree is a chain with the ring's latency: ring wins
    assert collective_algorithm(CommOp("x", "all_reduce", 8, 8, 1, "tp"), H100) == "ring"


def test_the_choice_is_the_faster_algorithm():
    for size in (1e2, 1e4, 1e6, 1e8):
        op = CommOp("x", "all_reduce", size, 128, 16, "dp")
        from parallelism.emulator.network import ring_seconds, tree_seconds
        assert collective_seconds(op, H100) == pytest.approx(min(ring_seconds(op, H100), tree_seconds(op, H100)))


def test_all_gather_and_reduce_scatter_move_half_of_all_reduce():
    n, size = 8, 1e9
    ag = collective_seconds(CommOp("ag", "all_gather", size, n, 1, "dp"), H100)
    rs = collective_seconds(CommOp("rs", "reduce_scatter", size, n, 1, "dp"), H100)
    assert ag == rs == pytest.approx((n - 1) / n * size / H100.intra_bw + (n - 1) * H100.intra_node_latency)


def test_p2p_all_to_all_and_trivial_groups():
    assert collective_seconds(CommOp("s", "send", 1e8, 2, 1, "pp"), H100) == pytest.approx(
        H100.intra_node_latency + 1e8 / H100.intra_bw)
    assert collective_seconds(CommOp("s", "send", 1e8, 2, 2, "pp"), H100) == pytest.approx(
        H100.inter_node_latency + 1e8 / H100.inter_bw)
    a2a = CommOp("moe", "all_to_all", 8e8, 16, 2, "ep")  # 7 peers on the node, 8 off it
    expected = 7 * (H100.intra_node_latency + 5e7 / H100.intra_bw) + 8 * (H100.inter_node_latency + 5e7 / H100.inter_bw)
    assert collective_seconds(a2a, H100) == pytest.approx(expected)
    assert collective_seconds(CommOp("x", "all_reduce", 1e9, 1, 1, "tp"), H100) == 0.0


def test_bad_collectives_are_refused():
    with pytest.raises(ValueError, match="group_size=0"):
        CommOp("x", "all_reduce", 1.0, 0, 1, "tp")
    with pytest.raises(ValueError, match="nodes=3 exceeds group_size=2"):
        CommOp("x", "all_reduce", 1.0, 2, 3, "tp")
    with pytest.raises(ValueError, match="bytes=-5"):
        CommOp("x", "all_reduce", -5, 2, 1, "tp")
    with pytest.raises(ValueError, match="kind='gather'"):
        CommOp("x", "gather", 5, 2, 1, "tp")
    with pytest.raises(ValueError, match="16 on a node, more than gpus_per_node=8"):
        collective_seconds(CommOp("x", "all_reduce", 1.0, 16, 1, "tp"), H100, 8)
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        collective_seconds(CommOp("x", "all_reduce", 1.0, 2, 1, "tp"), H100, 0)


TABLE = {"all_reduce": {"2": [[4096.0, 1e-3], [65536.0, 2e-3], [1048576.0, 4e-3]]}}


def test_a_measured_table_replaces_the_model_inside_one_node():
    cpu = replace(get_profile("cpu"), collective_table=TABLE)

    def op(size, group=2, nodes=1, kind="all_reduce"):
        return CommOp("x", kind, size, group, nodes, "tp")

    assert collective_seconds(op(4096.0), cpu, 2) == 1e-3            # at a measured point
    assert collective_seconds(op(1024.0), cpu, 2) == 1e-3            # below the smallest: its time
    assert math.isclose(collective_seconds(op(16384.0), cpu, 2), 1.5e-3)  # halfway in log(size)
    # above the largest: the last segment's rate, 2e-3 s per 983,040 bytes
    assert math.isclose(collective_seconds(op(2 * 1048576.0), cpu, 2), 4e-3 + 1048576 * 2e-3 / 983040)
    # other group sizes, other kinds and groups over several nodes use the model
    assert measured_seconds(op(4096.0, group=4), cpu) is None
    assert measured_seconds(op(4096.0, kind="all_gather"), cpu) is None
    assert measured_seconds(op(4096.0, nodes=2), cpu) is None
    assert collective_seconds(op(4096.0, nodes=2), cpu, 1) == collective_seconds(op(4096.0, nodes=2), get_profile("cpu"), 1)


@pytest.mark.parametrize("table, message", [
    ({"all_reduce": {"1": [[1.0, 1.0], [2.0, 2.0]]}}, "group size >= 2"),
    ({"all_reduce": {"2": [[2.0, 1.0], [1.0, 2.0]]}}, "sizes must ascend"),
    ({"all_reduce": {"2": [[1.0, 1.0]]}}, "at least two"),
    ({"all_reduce": {"2": [[1.0, -1.0], [2.0, 1.0]]}}, "positive numbers"),
])
def test_a_bad_collective_table_is_refused_by_name(table, message):
    with pytest.raises(EmulatorError, match=message):
        replace(get_profile("cpu"), collective_table=table)
