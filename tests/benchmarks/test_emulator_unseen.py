"""benchmarks.emulator_unseen: published runs the emulator was not tuned on, each compared by its
published step time (one row run here; the whole set is the benchmark's, docs/benchmarks.md)."""
from __future__ import annotations

import json

import pytest

from benchmarks import emulator_unseen

pytestmark = pytest.mark.timeout(300)


def test_a_row_is_emulated_as_it_ran_and_compared_by_its_step(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))
    out = tmp_path / "rows.json"
    assert emulator_unseen.main(["--only", "nemotron-4-15b FP8", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert row["published_step_seconds"] == 1.98 and row["gpus"] == 16 and row["layout"] == "tp=2,pp=1,dp=8,zero=1"
    assert "fp8 (delayed)" in row["run_as"] and "accumulation fused" in row["run_as"]
    # positive error: predicted too fast; the TFLOP/s ratio is the step ratio
    assert row["error"] == pytest.approx(row["published_step_seconds"] / row["predicted_step_seconds"] - 1)
    printed = capsys.readouterr().out
    assert "NVIDIA DGX Cloud Benchmarking recipes" in printed and "mean absolute error" in printed


def test_every_row_names_its_source_and_publishers_are_three() -> None:
    sources = {run.source for run in emulator_unseen.RUNS}
    assert {s.split(" ")[0] for s in sources} == {"NVIDIA", "MLCommons", "Trainy"}
    assert all(run.published_step_seconds and run.published_step_seconds > 0 for run in emulator_unseen.RUNS)
