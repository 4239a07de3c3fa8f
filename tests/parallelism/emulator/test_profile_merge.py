"""`dynaplane calibrate --merge`: calibrations taken at different times, combined at their median."""
from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism.emulator.devices import get_profile, load_profile, save_profile
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.profile_merge import machine_speeds, median_profile, quietest_calibration


def calibrated(scale: float, **changes):
    """A calibration-shaped profile whose measurements are the cpu profile's times `scale`."""
    measured = dict(
        name="cpu-calibrated", launch_seconds=20e-6 * scale, hbm_bandwidth=40e9 / scale,
        peak_flops={"bf16": 200e9 / scale, "fp32": 100e9 / scale}, op_bandwidth={"add": 30e9 / scale},
        collective_table={"all_reduce": {"2": [[4096, 1e-4 * scale], [1 << 20, 1e-3 * scale]]}},
        matmul_table={"bf16": {"nt": [[1, 128, 768, 768, 2e11 / scale]]}},
        op_bandwidth_table={"add": [[4096, 9e9 / scale], [1 << 24, 3e10 / scale]]})
    return dataclasses.replace(get_profile("cpu"), **{**measured, **changes})


def test_every_measurement_is_its_median_over_the_calibrations() -> None:
    merged = median_profile([calibrated(1.0), calibrated(3.0), calibrated(1.2)])
    assert merged.launch_seconds == pytest.approx(24e-6)
    assert merged.hbm_bandwidth == pytest.approx(40e9 / 1.2)
    assert merged.peak_flops == pytest.approx({"bf16": 200e9 / 1.2, "fp32": 100e9 / 1.2})
    assert merged.collective_table["all_reduce"]["2"] == [[4096, pytest.approx(1.2e-4)], [1 << 20, pytest.approx(1.2e-3)]]
    assert merged.matmul_table["bf16"]["nt"] == [[1, 128, 768, 768, pytest.approx(2e11 / 1.2)]]
    assert merged.op_bandwidth_table["add"][1] == [1 << 24, pytest.approx(3e10 / 1.2)]
    assert merged.hbm_bytes == calibrated(1.0).hbm_bytes and merged.name == "cpu-calibrated"
    assert merged.notes.startswith("median of 3 calibrations")


@given(st.lists(st.floats(0.25, 4.0), min_size=1, max_size=7))
def test_the_median_lies_between_the_calibrations_and_ignores_their_order(scales) -> None:
    profiles = [calibrated(s) for s in scales]
    merged = median_profile(profiles)
    assert min(scales) * 20e-6 * (1 - 1e-9) <= merged.launch_seconds <= max(scales) * 20e-6 * (1 + 1e-9)
    assert median_profile(profiles[::-1]).to_dict() == merged.to_dict() or len(scales) == 1
    rows = merged.collective_table["all_reduce"]["2"]
    assert rows[0][1] <= rows[1][1]  # medians of non-decreasing curves stay non-decreasing


def test_calibrations_of_different_shapes_or_machines_are_refused() -> None:
    other_shapes = calibrated(1.0, matmul_table={"bf16": {"nt": [[1, 256, 768, 768, 2e11]]}})
    with pytest.raises(EmulatorError, match=r"matmul_table.*different shapes or sizes.*--layout"):
        median_profile([calibrated(1.0), other_shapes])
    other_kinds = calibrated(1.0, op_bandwidth={"add": 1e9, "sqrt": 1e9})
    with pytest.raises(EmulatorError, match=r"op_bandwidth.*different entries"):
        median_profile([calibrated(1.0), other_kinds])
    bigger = calibrated(1.0, hbm_bytes=calibrated(1.0).hbm_bytes * 2)
    with pytest.raises(EmulatorError, match=r"hbm_bytes differs.*same machine"):
        median_profile([calibrated(1.0), bigger])
    with pytest.raises(EmulatorError, match="no profiles"):
        median_profile([])


def test_the_command_writes_the_median_profile(tmp_path) -> None:
    paths = []
    for n, scale in enumerate((1.0, 2.0, 5.0)):
        paths.append(str(tmp_path / f"c{n}.json"))
        save_profile(calibrated(scale), paths[-1])
    out = tmp_path / "var" / "merged.json"  # a folder not made yet, as in a fresh checkout
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--merge", *paths, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_profile(out).launch_seconds == pytest.approx(40e-6)
    assert "merged 3 calibrations" in done.stderr and f"wrote {out}" in done.stdout

    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--merge", *paths, "--out", str(out),
                           "--model", "tiny-gpt"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--merge combines profiles already measured; it takes no --model" in done.stderr
    save_profile(calibrated(1.0, hbm_bytes=1 << 30), paths[0])
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--merge", *paths, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "hbm_bytes differs" in done.stderr


@given(st.lists(st.floats(0.3, 3.0), min_size=2, max_size=6, unique=True))
def test_the_quietest_calibration_is_the_one_whose_window_ran_fastest(scales) -> None:
    profiles = [calibrated(scale) for scale in scales]
    index, speeds = quietest_calibration(profiles)
    assert index == scales.index(min(scales)) and speeds == machine_speeds(profiles)
    # a slower window reads slower, and with every measurement scaled together (an odd count:
    # the median is one of them) a window's speed is the median window's time over its own
    by_scale = [speed for _, speed in sorted(zip(scales, speeds))]
    assert by_scale == sorted(by_scale, reverse=True)
    if len(scales) % 2:
        for scale, speed in zip(scales, speeds):
            assert speed == pytest.approx(statistics.median(scales) / scale)


def test_collective_times_count_as_slower_when_longer() -> None:
    """Only the collectives differ: the calibration with the shorter ones is the quieter."""
    def with_collectives(seconds: float):
        return calibrated(1.0, collective_table={"all_reduce": {"2": [[4096, seconds], [1 << 20, 10 * seconds]]}})

    assert quietest_calibration([with_collectives(2e-4), with_collectives(1e-4), with_collectives(3e-4)])[0] == 1
    with pytest.raises(EmulatorError, match="different entries"):
        machine_speeds([calibrated(1.0), calibrated(1.0, op_bandwidth={"mul": 3e10})])


def test_the_command_keeps_the_quietest_calibration(tmp_path) -> None:
    paths = []
    for n, scale in enumerate((2.0, 1.0, 5.0)):
        paths.append(str(tmp_path / f"c{n}.json"))
        save_profile(calibrated(scale), paths[-1])
    out = tmp_path / "quietest.json"
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--merge", *paths, "--quietest",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_profile(out).launch_seconds == pytest.approx(20e-6)
    assert f"kept {paths[1]}, the quietest of 3 calibrations" in done.stderr
    done = subprocess.run([sys.executable, "-m", "dynaplane", "calibrate", "--quietest", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--quietest chooses among calibrations given with --merge" in done.stderr
