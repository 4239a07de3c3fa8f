"""Device profiles and their efficiency model."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from parallelism.emulator.costs import compute_seconds
from parallelism.emulator.devices import PROFILES, DeviceProfile, get_profile, load_profile, save_profile
from parallelism.emulator.trace import ComputeOp


def test_spec_sheet_numbers():
    assert get_profile("a100").peak("bf16") == 312e12
    assert get_profile("h100").peak("bf16") == 989.4e12
    assert get_profile("h200").peak("bf16") == 989.4e12
    assert get_profile("b200").peak("bf16") == 2250e12
    assert [get_profile(n).peak("fp8") for n in ("h100", "h200", "b200")] == [1978.9e12, 1978.9e12, 4500e12]
    assert [get_profile(n).hbm_bandwidth for n in ("a100", "h100", "h200", "b200")] == [2.039e12, 3.35e12, 4.8e12, 8e12]
    assert get_profile("h200").hbm_bytes > 140e9 > get_profile("h100").hbm_bytes > 80e9
    assert get_profile("a100").intra_node_bandwidth == 300e9  # NVLink3, one direction
    assert get_profile("h100").inter_node_bandwidth == 50e9   # 400 Gb/s NDR per GPU


def test_unknown_device_is_named():
    with pytest.raises(ValueError, match="unknown device 'tpu-v5'; known: a100, b200, cpu, h100, h200"):
        get_profile("tpu-v5")
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        get_profile("a100").peak("fp8")  # Ampere has no FP8 tensor cores
    with pytest.raises(ValueError, match="dtype 'fp4'"):
        get_profile("h100").peak("fp4")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_matmul_efficiency_saturates_below_the_max_fraction(name):
    p = get_profile(name)
    big = p.matmul_efficiency((16384, 16384, 16384))
    assert 0.9 * p.matmul_max_fraction < big <= p.matmul_max_fraction
    assert p.matmul_efficiency((64, 64, 64)) < p.matmul_efficiency((1024, 1024, 1024)) <= big
    assert p.matmul_efficiency(()) == p.matmul_max_fraction
    assert 0 < p.attention_efficiency((1, 8, 512, 512, 128)) < p.attention_efficiency((4, 32, 8192, 8192, 128)) <= p.attention_fraction


def test_wave_quantization_one_tile_more_than_a_wave():
    h100 = get_profile("h100")  # 132 SMs, 128x128 tiles
    full = h100.matmul_efficiency((128 * 132, 128, 8192))
    spill = h100.matmul_efficiency((128 * 133, 128, 8192))
    assert spill == pytest.approx(full * 133 / 264)


def test_roofline_large_gemm_and_memory_bound_op():
    h100 = get_profile("h100")
    gemm = ComputeOp("mm", "matmul", 2 * 8192**3, 3 * 8192**2 * 2, (8192, 8192, 8192))
    t = compute_seconds(gemm, h100)
    assert 1.3e-3 < t < 1.7e-3  # ~ 700-800 TFLOP/s, what cuBLAS reaches on H100 SXM
    norm = ComputeOp("rms", "memory", 5 * 2**27, 2 * 2**27 * 2)
    assert compute_seconds(norm, h100) == pytest.approx(2 * 2**27 * 2 / (3.35e12 * 0.8) + h100.launch_seconds)


def test_profile_json_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    mine = replace(get_profile("cpu"), name="calibrated", matmul_max_fraction=0.55, notes="measured")
    save_profile(mine, path)
    assert load_profile(path) == mine
    data = json.loads(path.read_text())
    data["hbm_bandwidth"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="hbm_bandwidth=-1"):
        load_profile(path)
    data["hbm_bandwidth"], data["warp_speed"] = 1e9, 9
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown keys \\['warp_speed'\\]"):
        load_profile(path)
    with pytest.raises(ValueError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")


def test_bad_profile_values():
    with pytest.raises(ValueError, match="matmul_max_fraction=1.5"):
        replace(get_profile("h100"), matmul_max_fraction=1.5)
    with pytest.raises(ValueError, match="peak_flops"):
        DeviceProfile.from_dict({**get_profile("h100").to_dict(), "peak_flops": {"bf16": 1e12}})


def test_fp8_gemms_reach_their_own_measured_fraction_of_the_fp8_peak():
    """H100's FP8 fraction is cuBLASLt's measured 1611 of 1978.9 TFLOP/s, not bf16's sweep; a
    profile without an FP8 measurement (B200) uses its bf16 fraction."""
    big = (16384, 16384, 16384)
    h100, b200 = get_profile("h100"), get_profile("b200")
    assert h100.matmul_efficiency(big, "fp8") / h100.matmul_efficiency(big) == pytest.approx(
        (1611.2 / 1978.9) / h100.matmul_max_fraction)
    assert h100.matmul_rate("fp8", big) == pytest.approx(1978.9e12 * h100.matmul_efficiency(big, "fp8"))
    assert b200.matmul_efficiency(big, "fp8") == b200.matmul_efficiency(big)
    with pytest.raises(ValueError, match=r"matmul_fraction_of\['fp8'\]=1.5 must be in \(0, 1\]"):
        DeviceProfile.from_dict({**h100.to_dict(), "matmul_fraction_of": {"fp8": 1.5}})
