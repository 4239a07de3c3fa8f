"""`dynaplane calibrate --device cuda` (calibrate_device.py): its measuring code run on CPU
tensors (real timings, small sizes), the profile it builds from a device's facts, and the
CLI's refusals where the GPUs it asks for are not there."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from parallelism.emulator.calibrate_device import (DeviceEffort, DeviceFacts, calibrate_device, device_profile,
                                                   kernel_gap_seconds, ring_fit, spec_part)
from parallelism.emulator.calibrate_ops import Clock, typical_seconds
from parallelism.emulator.devices import get_profile, load_profile, save_profile
from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.tracer import TraceRequest

GiB = 2**30
TINY = DeviceEffort(repeats=1, gemm_shapes=((64, 64, 64),), short_k=(64, 64, 8), attention_shape=(1, 2, 32, 16),
                    bandwidth_tensors=2, op_sizes=(1 << 8, 1 << 12), table_sizes=(1 << 12, 1 << 14),
                    table_iterations=2, gap_kernels=20)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_device_path_on_cpu_ranks_writes_a_profile_that_emulate_takes(tmp_path) -> None:
    request = TraceRequest("tiny-gpt", "tp=1,pp=1,dp=2", 1, 32, 1, 2)
    profile = calibrate_device(2, [request], "cpu", TINY)
    out = tmp_path / "device.json"
    save_profile(profile, out)
    assert load_profile(out) == profile
    assert profile.name == "calibrated cpu" and profile.comm_streams and profile.comm_overlap == 1.0
    assert (profile.dispatch_seconds, profile.collective_host_seconds, profile.p2p_host_seconds) == (0.0, 0.0, 0.0)
    assert profile.launch_seconds > 0 and profile.sm_count == 0
    # the traced step's GEMMs and attentions at their own shapes, memory-bound ops by size
    assert {"nt", "nn", "tn"} <= set(profile.matmul_table["bf16"])
    assert set(profile.attention_table) == {"forward", "backward"}
    assert [p[0] for p in profile.op_bandwidth_table["add"]] == sorted(p[0] for p in profile.op_bandwidth_table["add"])
    assert len(profile.op_bandwidth_table["add"]) == 2
    # collectives between the two ranks: the ladder and the trace's own sizes, non-decreasing
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        points = profile.collective_table[kind]["2"]
        assert {4096.0, 16384.0} <= {p[0] for p in points}
        assert all(a[1] <= b[1] for a, b in zip(points, points[1:]))
    assert profile.intra_node_latency > 0 and profile.intra_node_bandwidth > 0
    result = emulate(EmulateRequest("tiny-gpt", "tp=1,pp=1,dp=2", 2, "h200", 2, 1, 32, gpus_per_node=2,
                                    profile=str(out)))
    assert result["gpu"] == "calibrated cpu" and result["step_seconds"] > 0
    done = subprocess.run([sys.executable, "-m", "dynaplane", "emulate", "--model", "tiny-gpt", "--layout",
                           "tp=1,pp=1,dp=1", "--gpus", "1", "--global-batch", "1", "--micro-batch", "1", "--seq",
                           "32", "--profile", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "calibrated cpu" in done.stdout


def _results(bf16: float, memory: float, table: dict | None = None, gap: float = 3e-6) -> dict:
    """One rank's measurements as measure_device_rank returns them."""
    return {"bf16": bf16, "bf16_forward": bf16, "fp32": bf16 / 15, "short_k": bf16 / 2, "short_k_inner": 256,
            "gemm_table": {"bf16": {"nt": [[1, 2048, 2048, 2048, bf16 * 0.9]]}},
            "attention_table": {"forward": {"bf16": [[1, 16, 2048, 2048, 128, bf16 / 2]]}},
            "attention": bf16 / 2, "ops_table": {"add": [[1e4, memory / 10], [1e9, memory]],
                                                 "mul": [[1e4, memory / 10], [1e9, memory]]},
            "gap": gap, "table": table or {}}


def test_a_known_part_keeps_its_spec_peaks_and_the_measurements_become_fractions() -> None:
    facts = DeviceFacts("cuda", "NVIDIA H200", 140 * GiB, 132, 60 * 2**20, 1)
    h200 = get_profile("h200")
    profile = device_profile(facts, [_results(700e12, 4.0e12)], 1)
    assert profile.name == "calibrated NVIDIA H200"
    assert profile.peak_flops == h200.peak_flops and profile.hbm_bandwidth == h200.hbm_bandwidth
    assert profile.matmul_max_fraction == pytest.approx(700e12 / h200.peak_flops["bf16"])
    assert profile.attention_fraction == pytest.approx(350e12 / h200.peak_flops["bf16"])
    assert profile.memory_fraction == pytest.approx(4.0e12 / h200.hbm_bandwidth)
    assert profile.hbm_bytes == 140 * GiB and profile.sm_count == 132 and profile.launch_seconds == 3e-6
    assert profile.matmul_k_half == pytest.approx(256.0)  # half the rate at k = 256
    # one GPU: no collective measured, the built-in part's network numbers, and the notes say so
    assert profile.collective_table == {}
    assert (profile.intra_node_bandwidth, profile.intra_node_latency, profile.inter_node_bandwidth) == (
        h200.intra_node_bandwidth, h200.intra_node_latency, h200.inter_node_bandwidth)
    assert "no collective measured" in profile.notes
    assert profile.comm_streams and profile.dispatch_seconds == profile.collective_host_seconds == 0.0


def test_a_known_part_keeps_the_kernel_rates_it_did_not_measure() -> None:
    facts = DeviceFacts("cuda", "NVIDIA A100-SXM4-80GB", 80 * GiB, 108, 40 * 2**20, 1)
    a100 = get_profile("a100")
    profile = device_profile(facts, [_results(260e12, 1.7e12)], 1)
    assert profile.op_bandwidth["add"] == 1.7e12  # measured
    assert a100.op_bandwidth and all(profile.op_bandwidth[name] == rate for name, rate in a100.op_bandwidth.items())


def test_an_unknown_part_takes_its_measured_rates_as_peaks() -> None:
    facts = DeviceFacts("cuda", "NVIDIA GeForce RTX 4090", 24 * GiB, 128, 72 * 2**20, 1)
    profile = device_profile(facts, [_results(150e12, 0.9e12)], 1)
    assert profile.peak_flops == {"bf16": 150e12, "fp32": 10e12}
    assert profile.matmul_max_fraction == 1.0 and profile.hbm_bandwidth == 0.9e12 and profile.memory_fraction == 1.0
    assert "no built-in part matches" in profile.notes
    assert profile.intra_node_bandwidth == get_profile("h100").intra_node_bandwidth


def test_collectives_take_the_slowest_rank_and_fit_the_ring_model() -> None:
    def table(scale: float) -> dict:
        rows = [[float(1 << e), scale * (2e-5 + (1 << e) / 300e9)] for e in range(12, 31, 2)]
        return {"all_reduce": rows, "all_gather": rows, "reduce_scatter": rows}

    facts = DeviceFacts("cuda", "NVIDIA H100 80GB HBM3", 80 * GiB, 132, 50 * 2**20, 2)
    profile = device_profile(facts, [_results(700e12, 3e12, table(1.0)), _results(710e12, 3e12, table(1.5))], 2)
    assert profile.peak_flops == get_profile("h100").peak_flops
    slow = table(1.5)["all_reduce"]
    assert profile.collective_table["all_reduce"]["2"] == slow
    assert profile.intra_node_efficiency == 1.0 and profile.intra_node_latency > 0
    assert profile.inter_node_bandwidth == get_profile("h100").inter_node_bandwidth


def test_the_ring_fit_recovers_the_latency_and_bandwidth_it_was_made_with() -> None:
    world, alpha, bandwidth = 8, 5e-6, 400e9
    hops = 2 * (world - 1)
    points = [[float(s), hops * alpha + hops / world * s / bandwidth] for s in (1 << e for e in range(12, 31))]
    fitted_alpha, fitted_bandwidth = ring_fit(points, world)
    assert fitted_alpha == pytest.approx(alpha, rel=0.2)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=0.05)


@pytest.mark.parametrize("name, part", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA B200", "b200"),
                                        ("NVIDIA GeForce RTX 4090", None)])
def test_a_device_name_matches_its_built_in_part(name, part) -> None:
    found = spec_part(name)
    assert (found.name if found else None) == part


def test_the_cpu_clock_times_the_call_and_a_flush_before_it_is_not_counted() -> None:
    assert Clock("cpu").time(lambda: time.sleep(0.02)) == pytest.approx(0.02, abs=0.015)
    seconds = typical_seconds(lambda: time.sleep(0.01), 3, before=lambda: time.sleep(0.05), device="cpu")
    assert 0.009 < seconds < 0.04
    assert 0 < kernel_gap_seconds("cpu", 50) < 1e-3


def test_calibrate_on_cuda_refuses_without_a_gpu_in_one_line(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "p.json"
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--device", "cuda", "--ranks", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --device cuda needs a CUDA GPU: torch.cuda.is_available() is False on this machine"]
    assert not out.exists()


def test_calibrate_on_cuda_refuses_more_ranks_than_gpus(monkeypatch) -> None:
    import torch

    from parallelism.emulator.cli import cuda_refusal

    # the one thing that cannot run here is the GPU itself
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_refusal(1) == ""
    assert cuda_refusal(2) == "--ranks 2 with --device cuda runs one rank per GPU; this machine has 1"


def test_merging_takes_no_device(tmp_path) -> None:
    profile = dataclasses.replace(get_profile("h200"), name="x")
    save_profile(profile, tmp_path / "a.json")
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--merge", str(tmp_path / "a.json"),
                           "--device", "cuda", "--out", str(tmp_path / "m.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "takes no --device cuda" in done.stderr
