"""Measured op tables: GEMM operand forms from the recorder, and how the cost model reads the tables."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from parallelism.emulator import calibrate_ops
from parallelism.emulator.calibrate_ops import (CacheFlush, ColdOperands, last_level_cache_bytes, measure_attentions,
                                           measure_gemms, measure_op_bandwidths, merge_tables, op_shapes,
                                           shapes_by_residency, typical_seconds)
from parallelism.emulator.costs import compute_seconds
from parallelism.emulator.devices import DeviceProfile, get_profile
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.op_tables import bandwidth_at, matmul_rate, nearest_rate
from parallelism.emulator.recorder import OpRecorder
from parallelism.emulator.trace import ComputeOp, StageMemory, StageTrace, Trace


def test_a_linear_layers_three_gemms_are_recorded_with_their_operand_forms() -> None:
    layer = torch.nn.Linear(8, 6, bias=False)
    x = torch.randn(5, 8, requires_grad=True)
    recorder = OpRecorder()
    with recorder:
        recorder.set_phase("forward")
        y = layer(x)
        recorder.set_phase("backward")
        y.backward(torch.randn_like(y))
    gemms = [(r.phase, r.shape, r.form) for r in recorder.records if r.kind == "matmul"]
    # forward x @ W^T; input gradient g @ W; weight gradient g^T @ x (order of the two is autograd's)
    assert gemms[0] == ("forward", (5, 6, 8), "nt")
    assert sorted(gemms[1:]) == [("backward", (5, 8, 6), "nn"), ("backward", (6, 8, 5), "tn")]


def test_an_in_place_op_counts_the_tensors_it_writes_once_as_its_out_of_place_twin_does() -> None:
    xs, ys = [torch.ones(64) for _ in range(3)], [torch.ones(64) for _ in range(3)]
    recorder = OpRecorder()
    with recorder:
        torch._foreach_addcdiv_(xs, ys, ys)  # returns nothing: the write is its first list
        torch._foreach_addcdiv(xs, ys, ys)
        torch._foreach_mul_(xs, 0.5)
        xs[0].add_(ys[0])  # returns its input: counted once, not twice
        torch.add(xs[0], 1.0)
    moved = {r.name: r.bytes for r in recorder.records}
    whole = 3 * 64 * 4
    assert moved["_foreach_addcdiv_"] == moved["_foreach_addcdiv"] == 4 * whole
    assert moved["_foreach_mul_"] == 2 * whole
    assert moved["add_"] == 3 * 256 and moved["add"] == 2 * 256  # one tensor of 256 bytes in, out


def test_an_in_place_write_is_not_new_memory() -> None:
    xs, ys = [torch.ones(64) for _ in range(3)], [torch.ones(64) for _ in range(3)]
    recorder = OpRecorder()
    with recorder:
        torch._foreach_addcdiv_(xs, ys, ys)
        torch._foreach_mul_(xs, 0.5)
        kept = torch._foreach_add(xs, 1.0)  # new tensors: these are
    assert recorder.live == recorder.peak == 3 * 256
    del kept


def test_nearest_rate_prefers_an_exact_match_then_the_nearest_shape_in_log_space() -> None:
    rows = [[1, 128, 768, 768, 400e9], [1, 128, 50304, 768, 130e9]]
    assert nearest_rate(rows, (1, 128, 50304, 768)) == 130e9
    assert nearest_rate(rows, (1, 128, 3072, 768)) == 400e9   # ln 4 from the first, ln 16.4 from the second
    assert nearest_rate(rows, (1, 128, 20000, 768)) == 130e9  # ln 26 vs ln 2.5
    assert nearest_rate([], (1, 2, 3, 4)) is None


def test_matmul_rate_reads_the_ops_own_form_and_falls_back_to_other_forms_then_the_model() -> None:
    table = {"bf16": {"nt": [[1, 32, 768, 768, 300e9]], "nn": [[1, 32, 768, 768, 30e9]]}}
    assert matmul_rate(table, "bf16", "nt", (32, 768, 768)) == 300e9
    assert matmul_rate(table, "bf16", "nn", (32, 768, 768)) == 30e9
    assert matmul_rate(table, "bf16", "tn", (32, 768, 768)) in (300e9, 30e9)  # not measured: nearest of any form
    assert matmul_rate(table, "fp16", "nn", (32, 768, 768)) == 30e9            # fp16 reads bf16's rows
    assert matmul_rate(table, "fp32", "nn", (32, 768, 768)) is None            # no rows for the dtype
    assert matmul_rate(table, "bf16", "nn", ()) is None                         # no shape to look up
    assert matmul_rate({}, "bf16", "nn", (32, 768, 768)) is None


def test_the_cost_model_charges_a_measured_gemm_its_measured_rate() -> None:
    cpu = get_profile("cpu")
    measured = replace(cpu, matmul_table={"bf16": {"nn": [[1, 64, 64, 64, 2e9]]}},
                       attention_table={"backward": {"bf16": [[1, 4, 64, 64, 16, 1e9]]}},
                       op_bandwidth_table={"add": [[1e3, 1e9], [1e6, 4e9]]})
    gemm = ComputeOp("mm", "matmul", 2 * 64**3, 3 * 64 * 64 * 2, (64, 64, 64), "bf16", "nn")
    assert compute_seconds(gemm, measured) == pytest.approx(2 * 64**3 / 2e9 + cpu.launch_seconds)
    assert compute_seconds(gemm, cpu) != compute_seconds(gemm, measured)  # built-in profile: efficiency model
    attention = ComputeOp("_scaled_dot_product_flash_attention_for_cpu_backward", "attention", 1e7, 0,
                          (1, 4, 64, 64, 16))
    assert compute_seconds(attention, measured) == pytest.approx(1e7 / 1e9 + cpu.launch_seconds)
    forward = replace(attention, name="_scaled_dot_product_flash_attention_for_cpu")  # no forward rows
    assert compute_seconds(forward, measured) == compute_seconds(forward, cpu)
    add = ComputeOp("add", "memory", 0, 1e6)
    assert compute_seconds(add, measured) == pytest.approx(1e6 / 4e9 + cpu.launch_seconds)


def test_an_allocation_moves_no_bytes_but_its_storage_is_live() -> None:
    recorder = OpRecorder()
    with recorder:
        buffer = torch.empty(1 << 20)
        other = torch.empty_strided((1024, 1024), (1024, 1))
        filled = torch.zeros(1 << 20)
    assert [(r.name, r.bytes) for r in recorder.records] == [("empty", 0.0), ("empty_strided", 0.0),
                                                               ("zeros", 4.0 * (1 << 20))]
    assert recorder.live == 3 * 4 * (1 << 20)  # all three hold memory
    del buffer, other, filled


def test_a_memory_bound_op_records_the_dtype_it_converts_from() -> None:
    master, grad = torch.randn(64), torch.randn(64, dtype=torch.bfloat16)
    param = torch.empty(64, dtype=torch.bfloat16)
    recorder = OpRecorder()
    with recorder:
        widened = grad.to(torch.float32, copy=True)  # a gradient into a new fp32 buffer
        widened.add_(grad)  # and added into it: fp32 += bf16
        param.copy_(master)  # a master into its bf16 parameter
        torch.mul(master, 2.0)  # reads only its own dtype
        torch.mm(grad.view(8, 8), grad.view(8, 8))  # not memory-bound: no source recorded
    found = [(r.name, r.source, r.dtype) for r in recorder.records]
    assert found == [("_to_copy", "bf16", "fp32"), ("add_", "bf16", "fp32"), ("copy_", "fp32", "bf16"),
                     ("mul", "", "fp32"), ("mm", "", "bf16")]


def test_a_memory_bound_op_takes_the_most_specific_measured_rate() -> None:
    cpu = get_profile("cpu")
    table = {"add": [[1e3, 1e9]], "add_": [[1e3, 2e9]], "add_:bf16>fp32": [[1e3, 4e9]],
             "_to_copy": [[1e3, 5e9]]}
    measured = replace(cpu, op_bandwidth_table=table)
    rate = {(name, source, dtype): measured.op_memory_bandwidth(name, 1e3, source, dtype)
            for name, source, dtype in [("add", "", "fp32"), ("add_", "", "fp32"), ("_foreach_add_", "", "fp32"),
                                        ("add_", "bf16", "fp32"), ("add", "bf16", "fp32"),
                                        ("add_", "fp16", "fp32"), ("_to_copy", "bf16", "fp32")]}
    assert rate == {("add", "", "fp32"): 1e9, ("add_", "", "fp32"): 2e9, ("_foreach_add_", "", "fp32"): 2e9,
                    ("add_", "bf16", "fp32"): 4e9,  # its own cast and place
                    ("add", "bf16", "fp32"): 1e9,  # out of place: not the in-place cast's rate
                    ("add_", "fp16", "fp32"): 2e9,  # a cast not measured: the op in place
                    ("_to_copy", "bf16", "fp32"): 5e9}  # the op's generic rate
    op = ComputeOp("add_", "memory", 0, 1e3, (), "fp32", source="bf16")
    assert compute_seconds(op, measured) == pytest.approx(1e3 / 4e9 + cpu.launch_seconds)
    # the gradient accumulation's own (cold) rate, where measured, before the cast's
    roles = replace(cpu, op_bandwidth_table={**table, "grad_accumulate:add_:bf16>fp32": [[1e3, 3e9]]})
    accumulate = ComputeOp("add_", "memory", 0, 1e3, (), "fp32", role="grad_accumulate", source="bf16")
    assert compute_seconds(accumulate, roles) == pytest.approx(1e3 / 3e9 + cpu.launch_seconds)
    assert compute_seconds(op, roles) == pytest.approx(1e3 / 4e9 + cpu.launch_seconds)  # no role: the warm cast
    assert compute_seconds(accumulate, measured) == pytest.approx(1e3 / 4e9 + cpu.launch_seconds)  # not measured
    with pytest.raises(EmulatorError, match="source='int8'"):
        ComputeOp("add_", "memory", 0, 1e3, (), "fp32", source="int8")


def test_the_embedding_gradient_is_priced_as_the_zero_fill_of_its_output() -> None:
    cpu = get_profile("cpu")
    measured = replace(cpu, op_bandwidth_table={"zero": [[1e6, 8e9], [1e8, 8e9]]}, op_bandwidth={})
    op = ComputeOp("embedding_dense_backward", "memory", 0, 49e6, (), "bf16")
    assert compute_seconds(op, measured) == pytest.approx(49e6 / 8e9 + cpu.launch_seconds)
    # no zero-fill measured: the generic memory rate, as for any unmeasured op
    assert replace(cpu, op_bandwidth_table={}, op_bandwidth={}).op_memory_bandwidth(
        "embedding_dense_backward", 49e6) == cpu.memory_bandwidth


def test_a_copy_into_a_tensor_of_its_own_dtype_is_priced_as_one_not_as_a_cast() -> None:
    """ZeRO's gathered bf16 parameters copied back into the model: `copy_` with no source
    takes the measured same-dtype copy_, never `copy` (a cast into a new tensor)."""
    cpu = get_profile("cpu")
    measured = replace(cpu, op_bandwidth={}, op_bandwidth_table={
        "copy": [[1e6, 10e9], [1e9, 10e9]], "copy_": [[1e6, 20e9], [1e9, 20e9]], "copy_:fp32>bf16": [[1e6, 15e9]]})
    same = ComputeOp("copy_", "memory", 0, 1.5e8, (), "bf16")
    cast = ComputeOp("copy_", "memory", 0, 1.5e8, (), "bf16", source="fp32")
    assert compute_seconds(same, measured) == pytest.approx(1.5e8 / 20e9 + cpu.launch_seconds)
    assert compute_seconds(cast, measured) == pytest.approx(1.5e8 / 15e9 + cpu.launch_seconds)
    unmeasured = replace(measured, op_bandwidth_table={"copy": [[1e6, 10e9]]})  # an older profile: as before
    assert compute_seconds(same, unmeasured) == pytest.approx(1.5e8 / 10e9 + cpu.launch_seconds)


def test_calibrate_times_in_place_ops_and_casts_as_the_recorder_counts_them() -> None:
    """Every measured case moves the bytes the recorder would count for the same call."""
    cases = calibrate_ops.op_cases(256, 2)
    for name in ("mul_", "add_", "div_", "addcdiv_", "addcmul_", "lerp_", "_to_copy:bf16>fp32", "add_:bf16>fp32",
                 "copy_:fp32>bf16", "copy_", "mul", "add", "_to_copy", "_fused_adamw_"):
        work, nbytes, calls = cases[name]
        recorder = OpRecorder()
        with recorder:
            work()
        records = [r for r in recorder.records if r.kind == "memory"]
        assert len(records) == calls, name
        assert sum(r.bytes for r in records) / calls == nbytes, name
        op = name.split(":")[0]
        assert all(r.name.removeprefix("_foreach_") == op for r in records), (name, records[0].name)
        signature = name.split(":")[1] if ":" in name else ""
        assert all(f"{r.source}>{r.dtype}" == signature for r in records) if signature else True, name


@given(st.lists(st.tuples(st.floats(1e2, 1e9), st.floats(1e6, 1e11)), min_size=2, max_size=5, unique_by=lambda p: p[0]),
       st.floats(1.0, 1e10))
@example([(100.0, 2148483649.0), (101.0, 1000000.2712228298)], 101.0)  # found by CI: exact at the last size
def test_bandwidth_by_size_interpolates_between_measured_points_and_clamps_outside(points, nbytes) -> None:
    points = sorted([list(p) for p in points])
    if any(b[0] / a[0] < 1.001 for a, b in zip(points, points[1:])):
        return
    rate = bandwidth_at(points, nbytes)
    rates = [p[1] for p in points]
    assert min(rates) * (1 - 1e-9) <= rate <= max(rates) * (1 + 1e-9)
    if nbytes <= points[0][0]:
        assert rate == points[0][1]
    if nbytes >= points[-1][0]:
        assert rate == points[-1][1]
    for p in points:
        assert math.isclose(bandwidth_at(points, p[0]), p[1], rel_tol=1e-9)


def test_a_profile_with_a_malformed_table_is_refused_with_the_place_named() -> None:
    cpu = get_profile("cpu")
    with pytest.raises(EmulatorError, match=r"matmul_table\['bf16'\]\['nn'\]: row \[1, 2, 3\]"):
        replace(cpu, matmul_table={"bf16": {"nn": [[1, 2, 3]]}})
    with pytest.raises(EmulatorError, match="attention_table key 'sideways'"):
        replace(cpu, attention_table={"sideways": {}})
    with pytest.raises(EmulatorError, match=r"op_bandwidth_table\['add'\]: sizes must ascend"):
        replace(cpu, op_bandwidth_table={"add": [[2e6, 1e9], [1e6, 1e9]]})
    data = replace(cpu, matmul_table={"bf16": {"nt": [[1, 8, 8, 8, 1e9]]}}).to_dict()
    assert DeviceProfile.from_dict(data).matmul_table == {"bf16": {"nt": [[1, 8, 8, 8, 1e9]]}}


def _trace_with(*ops: ComputeOp) -> Trace:
    memory = StageMemory(0, 0, 0, 0, 0)
    return Trace("tiny-gpt", 1, 1, 1, 1, 1, 8, (StageTrace(0, ops, ops, (), (), (), memory),))


def test_calibrate_measures_each_distinct_shape_of_the_traces_once_at_its_own_form() -> None:
    ops = (ComputeOp("mm", "matmul", 1, 1, (16, 24, 8), "bf16", "nt"),
           ComputeOp("mm", "matmul", 1, 1, (16, 24, 8), "bf16", "nt"),
           ComputeOp("bmm", "matmul", 1, 1, (2, 16, 8, 8), "fp32", "tn"),
           ComputeOp("sdpa", "attention", 1, 1, (1, 2, 16, 16, 8), "fp32"),
           ComputeOp("sdpa_backward", "attention", 1, 1, (1, 2, 16, 16, 8), "fp32"),
           ComputeOp("add", "memory", 1, 1))
    gemms, attentions = op_shapes([_trace_with(*ops)])
    assert gemms == [("bf16", "nt", 1, 16, 24, 8), ("fp32", "tn", 2, 16, 8, 8)]
    assert attentions == [("backward", "fp32", 1, 2, 16, 16, 8), ("forward", "fp32", 1, 2, 16, 16, 8)]
    table = measure_gemms(gemms, repeats=1)
    assert [row[:4] for row in table["bf16"]["nt"]] == [[1, 16, 24, 8]] and table["bf16"]["nt"][0][4] > 0
    assert [row[:4] for row in table["fp32"]["tn"]] == [[2, 16, 8, 8]]
    rates = measure_attentions(attentions, repeats=1)
    assert set(rates) == {"forward", "backward"} and rates["forward"]["fp32"][0][:5] == [1, 2, 16, 16, 8]
    # the table the profile then reads
    profile = replace(get_profile("cpu"), matmul_table=table, attention_table=rates)
    assert profile.matmul_rate("bf16", (16, 24, 8), "nt") == table["bf16"]["nt"][0][4]


def _trace_holding(static_bytes: int, *ops: ComputeOp) -> Trace:
    memory = StageMemory(static_bytes, 0, 0, 0, 0)
    return Trace("tiny-gpt", 1, 1, 1, 1, 1, 8, (StageTrace(0, ops, (), (), (), (), memory),))


def test_gemms_of_a_model_larger_than_the_cache_are_timed_cold_the_others_hot() -> None:
    shared = ComputeOp("mm", "matmul", 1, 1, (16, 24, 8), "bf16", "nt")
    only_small = ComputeOp("mm", "matmul", 1, 1, (4, 4, 4), "bf16", "nn")
    only_big = ComputeOp("sdpa", "attention", 1, 1, (1, 2, 16, 16, 8), "bf16")
    cache = 32 * 2**20
    shapes = shapes_by_residency([_trace_holding(cache // 8, shared, only_small),
                                  _trace_holding(cache * 4, shared, only_big)], cache)
    assert shapes["cold"] == ([("bf16", "nt", 1, 16, 24, 8)], [("forward", "bf16", 1, 2, 16, 16, 8)])
    assert shapes["hot"] == ([("bf16", "nn", 1, 4, 4, 4)], [])  # a shape of both kinds: cold only


def test_tables_of_cold_and_hot_shapes_merge_into_one() -> None:
    cold = {"bf16": {"nt": [[1, 16, 24, 8, 1e9]]}}
    hot = {"bf16": {"nt": [[1, 4, 4, 4, 2e9]], "nn": [[1, 4, 4, 4, 3e9]]}, "fp32": {"tn": [[1, 2, 2, 2, 4e9]]}}
    assert merge_tables(cold, hot) == {"bf16": {"nt": [[1, 16, 24, 8, 1e9], [1, 4, 4, 4, 2e9]],
                                                "nn": [[1, 4, 4, 4, 3e9]]},
                                       "fp32": {"tn": [[1, 2, 2, 2, 4e9]]}}
    assert cold == {"bf16": {"nt": [[1, 16, 24, 8, 1e9]]}}  # the inputs are left as they were


def test_a_timed_run_follows_a_cache_flush_each_time() -> None:
    order = []
    typical_seconds(lambda: order.append("run"), 3, before=lambda: order.append("flush"))
    assert order == ["run"] + ["flush", "run"] * 3  # the warm-up, then every timed run after a flush
    flush = CacheFlush(1 << 20)
    assert flush.buffer.numel() * 4 == 2 << 20  # twice the cache
    flush()
    assert bool((flush.buffer == 1.0).all())
    assert last_level_cache_bytes() >= 1 << 20  # this machine's largest cache (sysfs), at least a MiB


def test_an_op_is_timed_at_its_median_run_not_its_fastest_or_mean(monkeypatch) -> None:
    """A step sums thousands of ops as they typically run: one lucky run (the fastest) or
    one preempted run (it would move the mean) must not set the op's time."""
    clock = [0.0]
    durations = iter([9.0, 0.001, 0.020, 0.030, 0.025, 5.0])  # warm-up first, then five timed runs

    class FakeTime:
        @staticmethod
        def perf_counter() -> float:
            return clock[0]

    def op() -> None:
        clock[0] += next(durations)

    monkeypatch.setattr(calibrate_ops, "time", FakeTime)
    assert typical_seconds(op, 5) == pytest.approx(0.025)


def test_cold_gemms_read_a_new_copy_of_the_right_operand_every_run() -> None:
    made = []

    def make() -> torch.Tensor:
        made.append(torch.full((4,), float(len(made))))
        return made[-1]

    pool = ColdOperands(make, operand_bytes=1000, cold_bytes=4500)
    assert len(made) == 6  # together more than cold_bytes: one pass over them evicts the first
    seen = []
    for _ in range(8):
        seen.append(int(pool.current()[0]))
        pool.advance()
    assert seen == [0, 1, 2, 3, 4, 5, 0, 1]
    assert len(ColdOperands(make, operand_bytes=10**9, cold_bytes=64).copies) == 2  # a big operand: two copies
    table = measure_gemms([("fp32", "nt", 1, 8, 8, 8), ("fp32", "tn", 2, 4, 6, 8)], repeats=2, cold_bytes=1 << 16)
    assert [row[:4] for row in table["fp32"]["nt"]] == [[1, 8, 8, 8]]
    assert [row[:4] for row in table["fp32"]["tn"]] == [[2, 4, 6, 8]]
    assert all(row[4] > 0 for rows in table["fp32"].values() for row in rows)


def test_memory_bound_rates_are_measured_per_call_size_net_of_the_host_cost() -> None:
    calls = []

    def cases(elements, tensors):
        xs = [torch.ones(elements) for _ in range(tensors)]
        calls.append(elements)
        return {"neg": (lambda: [x.neg() for x in xs], 8.0 * elements, tensors)}

    synced = []
    table = measure_op_bandwidths(cases, tensors=2, repeats=1, ladder=(1 << 10, 1 << 16),
                                  sync=lambda: synced.append(calls[-1]))
    assert calls == [1, 1 << 10, 1 << 16]
    assert synced == [1 << 10, 1 << 16]  # the ranks meet before each op at each size
    assert [p[0] for p in table["neg"]] == [8.0 * (1 << 10), 8.0 * (1 << 16)]
    assert all(p[1] > 0 for p in table["neg"])


def test_calibrate_times_the_traces_collectives_at_their_own_sizes() -> None:
    from parallelism.emulator.calibrate_ops import collective_sizes
    from parallelism.emulator.trace import CommOp

    def comm(kind, size, group=2, nodes=1):
        return CommOp("c", kind, size, group, nodes, "dp")

    memory = StageMemory(0, 0, 0, 0, 0)
    stage = StageTrace(0, (comm("all_reduce", 4096.0), comm("all_reduce", 4100.0)), (comm("all_gather", 5e8),),
                       (), (comm("reduce_scatter", 3e8), comm("all_reduce", 1e9, group=4)),
                       (comm("all_gather", 2e8), comm("send", 1e6), comm("all_gather", 7e7, nodes=2)), memory)
    sizes = collective_sizes([Trace("tiny-gpt", 1, 1, 2, 1, 1, 8, (stage,))], world=2)
    # 4100 is within 2% of 4096: one table point; other group sizes, other nodes and p2p are not ours
    assert sizes == {"all_reduce": [4096.0], "all_gather": [2e8, 5e8], "reduce_scatter": [3e8]}


def test_cold_gemms_write_each_run_into_an_output_the_previous_run_did_not_touch(monkeypatch) -> None:
    written = []
    real_matmul = torch.matmul

    def recording(a, b, out=None):
        written.append(None if out is None else out.data_ptr())
        return real_matmul(a, b, out=out)

    monkeypatch.setattr(torch, "matmul", recording)
    measure_gemms([("fp32", "tn", 1, 64, 32, 8)], repeats=4, cold_bytes=3 * 64 * 32 * 4)
    assert None not in written  # every run writes into a ready output, not a new allocation
    assert all(a != b for a, b in zip(written, written[1:]))  # never the lines the run before wrote
    written.clear()
    measure_gemms([("fp32", "tn", 1, 64, 32, 8)], repeats=2)  # hot: as torch.matmul in a loop
    assert written == [None] * 3


def test_only_the_gradient_accumulation_cases_are_timed_after_a_cache_flush() -> None:
    from parallelism.emulator.calibrate_ops import COLD_CASES

    cases_measured = calibrate_ops.op_cases(4, 1)
    assert {"grad_accumulate:add_:bf16>fp32", "grad_accumulate:_to_copy:bf16>fp32"} <= COLD_CASES <= set(cases_measured)
    assert {"add_:bf16>fp32", "_to_copy:bf16>fp32"} <= set(cases_measured) - COLD_CASES  # the same casts elsewhere: warm
    timeline = []

    def cases(elements, tensors):
        x = torch.ones(elements)
        return {"grad_accumulate:add_:bf16>fp32": (lambda: timeline.append("cold") or x.add_(1.0), 12.0 * elements, 1),
                "neg": (lambda: timeline.append("warm") or x.neg(), 8.0 * elements, 1)}

    measure_op_bandwidths(cases, tensors=1, repeats=2, ladder=(1 << 10, 1 << 12), flush=lambda: timeline.append("flush"))
    sized = timeline[6:]  # after the one-element runs (warm-up + 2 of each case), which are not flushed
    assert timeline[:6] == ["cold"] * 3 + ["warm"] * 3
    # at each size: the cold case's warm-up, then flush before each timed run; the warm case never
    assert sized == ["cold", "flush", "cold", "flush", "cold", "warm", "warm", "warm"] * 2


def test_cold_attentions_read_a_new_operand_set_each_run_and_time_the_backward_alone(monkeypatch) -> None:
    import torch.nn.functional as F

    calls = []
    real_sdpa, real_grad = F.scaled_dot_product_attention, torch.autograd.grad

    def sdpa(q, k, v, **kwargs):
        calls.append(("forward", q.data_ptr()))
        return real_sdpa(q, k, v, **kwargs)

    def grad(outputs, inputs, grad_outputs, **kwargs):
        assert kwargs.get("retain_graph")  # the forward it runs through is kept for the next run of this set
        calls.append(("backward", inputs[0].data_ptr()))
        return real_grad(outputs, inputs, grad_outputs, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(torch.autograd, "grad", grad)
    one_set = 4 * 2 * 16 * 8 * 4  # q, k, v and the gradient of [1, 2, 16, 8] fp32
    rates = measure_attentions([("backward", "fp32", 1, 2, 16, 16, 8)], repeats=3, cold_bytes=3 * one_set)
    made = [c for c in calls if c[0] == "forward"]  # one forward per set of the pool, none timed
    timed = [c for c in calls if c[0] == "backward"]
    assert len(made) >= 3 and len(timed) == 4  # warm-up + 3
    assert all(a[1] != b[1] for a, b in zip(timed, timed[1:]))  # each run reads the next set's q
    assert rates["backward"]["fp32"][0][5] > 0
