"""The emulator's device check (benchmarks/emulator_gpu_check.py), rehearsed on CPU: every
section runs (calibrate's device path, ParallelTrainer's step in a one-rank world, emulate
on the calibrated and the built-in profile) and the report compares them; on a machine
without CUDA the device run refuses with exit code 2."""
from __future__ import annotations

import json

import pytest

from benchmarks import emulator_gpu_check
from parallelism.emulator.devices import load_profile


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_rehearsal_compares_a_real_step_with_both_predictions(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))
    out = tmp_path / "report"
    assert emulator_gpu_check.main(["--device", "cpu", "--model", "tiny-gpt", "--out", str(out), "--steps", "3",
                                    "--warmup", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["machine"]["device"] == "cpu"
    assert report["config"] == {"model": "tiny-gpt", "layout": "tp=1,pp=1,dp=1", "seq": 64, "device": "cpu",
                                "builtin_profile": "cpu", "micro_batch": 16}
    assert load_profile(out / "profile.json").name == "calibrated cpu"
    step = report["step"]
    assert step["seconds"] > 0 and len(step["all_seconds"]) == 3 and step["peak_bytes"] > 0
    rows = report["comparison"]
    assert [r["gpu"] for r in rows] == ["calibrated cpu", "cpu"]
    for r in rows:
        assert r["measured_step_seconds"] == step["seconds"] and r["predicted_step_seconds"] > 0
        assert r["step_error_pct"] == pytest.approx(
            100 * (r["predicted_step_seconds"] - step["seconds"]) / step["seconds"], abs=0.06)
    text = (out / "report.md").read_text()
    assert "| calibrated cpu |" in text and "real step: median" in text


def test_without_cuda_the_device_run_refuses(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert emulator_gpu_check.main(["--out", str(tmp_path)]) == 2
    assert not (tmp_path / "report.json").exists()
