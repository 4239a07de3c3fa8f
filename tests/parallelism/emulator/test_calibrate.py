"""`dynaplane calibrate`: the profile it writes, and how it finds the real program's host costs."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from hypothesis import given
from hypothesis import strategies as st

from parallelism.emulator.calibrate import (PROGRAM_MICRO_BATCHES, PROGRAM_MODEL, PROGRAM_SEQ, commless_seconds,
                                       median_of_passes, nondecreasing, nonnegative_lstsq, program_host_costs,
                                       program_layouts, shape_traces, solved_host_cost, without_comm)
from parallelism.emulator.calibrate_ops import collective_sizes
from parallelism.emulator.devices import get_profile, load_profile
from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.simulate import simulate
from parallelism.emulator.stage_cost import meetings as count_meetings
from parallelism.emulator.tracer import TraceRequest, trace


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))


def _steps(profile, world: int) -> dict[str, float]:
    """What commless_program_step would measure on a machine that is `profile`."""
    return {layout: commless_seconds(trace(TraceRequest(PROGRAM_MODEL, layout, 1, PROGRAM_SEQ, PROGRAM_MICRO_BATCHES,
                                                        world))[0], profile, world)
            for layout in program_layouts(world)}


def test_host_costs_are_the_ones_that_make_the_program_steps_meet_their_measured_times() -> None:
    estimate = dataclasses.replace(get_profile("cpu"), launch_seconds=5e-6, dispatch_seconds=2e-6,
                                   collective_host_seconds=1e-4, p2p_host_seconds=1e-4)
    truth = dataclasses.replace(estimate, launch_seconds=31e-6, dispatch_seconds=13e-6, collective_host_seconds=2e-3,
                                p2p_host_seconds=5e-4)
    launch, dispatch, collective, p2p = program_host_costs(estimate, 2, _steps(truth, 2))
    assert launch == pytest.approx(31e-6, rel=0.02) and dispatch == pytest.approx(13e-6, rel=0.05)
    assert collective == pytest.approx(2e-3, rel=0.05) and p2p == pytest.approx(5e-4, rel=0.05)
    # Steps faster than the kernels alone allow cannot be explained by host costs: the estimates stay.
    too_fast = {layout: seconds / 100 for layout, seconds in _steps(truth, 2).items()}
    assert program_host_costs(estimate, 2, too_fast) == (5e-6, 2e-6, 1e-4, 1e-4)
    # A plain layout alone (one rank, or an odd count) cannot decide the DTensor, the
    # per-collective or the per-p2p cost: they keep their estimates and the per-op cost
    # explains the step.
    plain = {layout: seconds for layout, seconds in _steps(truth, 2).items() if layout.startswith("tp=1,pp=1")
             and layout.endswith("zero=1")}
    launch, dispatch, collective, p2p = program_host_costs(estimate, 2, plain)
    assert (dispatch, collective, p2p) == (2e-6, 1e-4, 1e-4)
    # (the per-op cost takes up what the kept estimates miss: above the truth, by as much as
    # the plain steps' few DTensor ops need, 5% with the fused optimizer's fewer kernels)
    assert 31e-6 < launch < 31e-6 * 1.1
    solved = dataclasses.replace(estimate, launch_seconds=launch)
    assert _steps(solved, 2).keys() >= plain.keys()
    assert all(_steps(solved, 2)[layout] == pytest.approx(seconds, rel=1e-3) for layout, seconds in plain.items())


def test_a_step_faster_than_the_other_costs_explain_holds_its_own_cost_at_zero() -> None:
    estimate = dataclasses.replace(get_profile("cpu"), launch_seconds=5e-6, dispatch_seconds=2e-6,
                                   collective_host_seconds=1e-4, p2p_host_seconds=1e-4)
    truth = dataclasses.replace(estimate, launch_seconds=31e-6, dispatch_seconds=13e-6, collective_host_seconds=0.0)
    steps = _steps(truth, 2)
    zero3 = next(layout for layout in steps if "zero=3" in layout)
    steps[zero3] *= 0.97  # noise: faster than the per-op and per-DTensor-op costs allow
    launch, dispatch, collective, _ = program_host_costs(estimate, 2, steps)
    assert collective == 0.0  # not negative, and not a fall-back to the estimates
    assert launch == pytest.approx(31e-6, rel=0.1) and dispatch == pytest.approx(13e-6, rel=0.25)


def test_the_per_p2p_cost_is_the_one_that_makes_a_real_pipeline_step_meet_its_time() -> None:
    """Oracle: a machine whose per-p2p host cost is known; its pipeline step, predicted in full
    (collectives and transfers at their costs), is what calibrate measures over a real group."""
    pipeline = trace(TraceRequest(PROGRAM_MODEL, "tp=1,pp=2,dp=1,zero=1", 1, PROGRAM_SEQ, PROGRAM_MICRO_BATCHES,
                                  2))[0]
    estimate = dataclasses.replace(get_profile("cpu"), launch_seconds=20e-6, p2p_host_seconds=0.0)

    def measured(p2p: float) -> float:
        return simulate(pipeline, dataclasses.replace(estimate, p2p_host_seconds=p2p), 2).step_seconds

    for truth in (3e-4, 7e-3):
        assert solved_host_cost("p2p_host_seconds", pipeline, estimate, 2, measured(truth)) == pytest.approx(
            truth, rel=1e-3)
    # a step no slower than predicted without it: no cost; one no p2p cost up to the ceiling explains: None
    assert solved_host_cost("p2p_host_seconds", pipeline, estimate, 2, 0.9 * measured(0.0)) == 0.0
    assert solved_host_cost("p2p_host_seconds", pipeline, estimate, 2, measured(0.02), ceiling=0.01) is None
    # without a pipeline there is no send to carry the cost
    plain = trace(TraceRequest(PROGRAM_MODEL, "tp=1,pp=1,dp=2,zero=1", 1, PROGRAM_SEQ, PROGRAM_MICRO_BATCHES, 2))[0]
    assert solved_host_cost("p2p_host_seconds", plain, estimate, 2,
                            2 * simulate(plain, estimate, 2).step_seconds) is None


def test_the_rendezvous_cost_is_the_one_that_makes_a_real_tensor_parallel_step_meet_its_time() -> None:
    """Oracle as above: a machine whose ranks lose a known time meeting at each of tensor
    parallelism's collectives; only layouts with such collectives can carry it."""
    tensor = trace(TraceRequest(PROGRAM_MODEL, "tp=2,pp=1,dp=1,zero=1", 1, PROGRAM_SEQ, PROGRAM_MICRO_BATCHES, 2))[0]
    estimate = dataclasses.replace(get_profile("cpu"), launch_seconds=20e-6, rendezvous_seconds=0.0)

    def measured(meet: float) -> float:
        return simulate(tensor, dataclasses.replace(estimate, rendezvous_seconds=meet), 2).step_seconds

    stage = tensor.stages[0]
    meetings = (count_meetings(stage.forward) + count_meetings(stage.backward)) * PROGRAM_MICRO_BATCHES
    assert meetings > 0
    assert measured(1e-3) - measured(0.0) == pytest.approx(meetings * 1e-3, rel=1e-6)  # each meeting, once
    for truth in (2e-4, 3e-3):
        assert solved_host_cost("rendezvous_seconds", tensor, estimate, 2, measured(truth)) == pytest.approx(
            truth, rel=1e-3)
    plain = trace(TraceRequest(PROGRAM_MODEL, "tp=1,pp=1,dp=2,zero=1", 1, PROGRAM_SEQ, PROGRAM_MICRO_BATCHES, 2))[0]
    assert solved_host_cost("rendezvous_seconds", plain, estimate, 2,
                            2 * simulate(plain, estimate, 2).step_seconds) is None
    # a fake group never waits: the host-cost solve sees no rendezvous
    assert without_comm(dataclasses.replace(estimate, rendezvous_seconds=1e-3)).rendezvous_seconds == 0.0



def test_nonnegative_least_squares_keeps_the_best_solution_without_negative_entries() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nonnegative_lstsq(a, np.array([2.0, 3.0, 5.0])) == pytest.approx([2.0, 3.0])
    assert nonnegative_lstsq(a, np.array([2.0, -1.0, 1.0])) == pytest.approx([1.5, 0.0])
    assert nonnegative_lstsq(a, np.array([-2.0, 1.0, -1.0])) is None  # no positive first entry


@pytest.mark.timeout(600)
def test_quick_calibration_writes_a_profile_that_emulate_uses(tmp_path) -> None:
    # Real measurements with 2 ranks sharing this machine's cores: minutes at full effort on
    # the 2-core CI machine (bf16 GEMMs there run at ~1 GFLOP/s), so the test takes --quick.
    out = tmp_path / "cpu.json"
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--out", str(out), "--ranks", "2", "--quick"],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr
    profile = load_profile(out)
    assert profile.peak("bf16") > 1e8 and profile.launch_seconds > 0 and profile.intra_bw > 0
    assert {"sqrt", "add", "cat", "copy"} <= set(profile.op_bandwidth)
    # the program's GEMMs timed at their own shapes and operand forms, memory-bound ops by size
    assert {"nt", "nn", "tn"} <= set(profile.matmul_table["bf16"])
    assert {"forward", "backward"} == set(profile.attention_table)
    assert len(profile.op_bandwidth_table["add"]) == 2
    assert profile.dispatch_seconds > 0
    assert not profile.comm_streams  # a CPU's data-parallel collectives block the thread that computes
    assert "host costs from tiny-gpt steps" in profile.notes
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        points = profile.collective_table[kind]["2"]
        assert [p[0] for p in points] == sorted(p[0] for p in points) and all(p[1] > 0 for p in points)
    # every collective size of the traced program layouts was timed itself, not extrapolated
    for kind, sizes in collective_sizes(shape_traces(2, []), 2).items():
        assert set(sizes) <= {p[0] for p in profile.collective_table[kind]["2"]}, kind
    result = emulate(EmulateRequest("tiny-gpt", "tp=2,pp=1,dp=1,zero=1", 2, "cpu", 4, 1, 16, gpus_per_node=2,
                                    profile=str(out)))
    assert result["gpu"] == "cpu-calibrated" and result["step_seconds"] > 0


def test_calibrate_refuses_a_bad_rank_count(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--out", str(tmp_path / "p.json"),
                           "--ranks", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--ranks 0 must be >= 1" in done.stderr


def test_calibrate_refuses_shapes_it_cannot_trace(tmp_path) -> None:
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--out", str(tmp_path / "p.json"),
                               *extra], capture_output=True, text=True, timeout=120)

    done = run("--layout", "tp=2")
    assert done.returncode == 2 and "--layout needs --model" in done.stderr
    done = run("--model", "tiny-gpt")
    assert done.returncode == 2 and "--model needs at least one --layout" in done.stderr
    done = run("--model", "tiny-gpt", "--layout", "tp=1,dp=2", "--global-batch", "3")
    assert done.returncode == 2 and "--global-batch 3 is not divisible by micro-batch x dp = 1 x 2" in done.stderr
    assert not (tmp_path / "p.json").exists()


def test_passes_are_combined_point_by_point_at_their_median() -> None:
    """Three passes a minute apart: a spell that slowed one pass moves no point."""
    passes = [{"bf16": 100.0, "table": {"all_reduce": [[4096.0, 0.002], [1 << 20, 0.009]]},
               "gemm_table": {"bf16": {"nt": [[1, 8, 8, 8, 5e9]]}}},
              {"bf16": 40.0, "table": {"all_reduce": [[4096.0, 0.001], [1 << 20, 0.030]]},
               "gemm_table": {"bf16": {"nt": [[1, 8, 8, 8, 1e9]]}}},
              {"bf16": 90.0, "table": {"all_reduce": [[4096.0, 0.003], [1 << 20, 0.010]]},
               "gemm_table": {"bf16": {"nt": [[1, 8, 8, 8, 4e9]]}}}]
    assert median_of_passes(passes) == {"bf16": 90.0,
                                        "table": {"all_reduce": [[4096.0, 0.002], [1 << 20, 0.010]]},
                                        "gemm_table": {"bf16": {"nt": [[1, 8, 8, 8, 4e9]]}}}


def test_a_noisy_collective_table_is_fitted_non_decreasing() -> None:
    assert nondecreasing([2.4, 0.2, 8.4, 0.3, 0.5]) == [0.2, 0.2, 0.3, 0.3, 0.5]
    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


@given(st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=12))
def test_the_fit_is_the_largest_non_decreasing_curve_under_the_measurements(values) -> None:
    fitted = nondecreasing(values)
    assert len(fitted) == len(values)
    assert all(a <= b for a, b in zip(fitted, fitted[1:]))
    assert all(f <= v for f, v in zip(fitted, values))   # noise only adds time: never above a measurement
    assert fitted[-1] == values[-1]
    assert nondecreasing(sorted(values)) == sorted(values)


def test_calibrate_refuses_an_output_it_could_not_write_before_measuring(tmp_path) -> None:
    """A calibration takes minutes; a path it cannot write is named at once, not after."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--out", str(blocker / "p.json"),
                           "--quick"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"--out {blocker / 'p.json'}: cannot make its folder" in done.stderr
    assert "measuring" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--out", str(tmp_path), "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "is a directory" in done.stderr


def test_a_refused_calibration_leaves_no_folder_behind(tmp_path) -> None:
    out = tmp_path / "not-yet" / "p.json"
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--out", str(out), "--ranks", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and not out.parent.exists()
