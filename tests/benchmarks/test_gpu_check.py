"""The device session's script (benchmarks/gpu_check.py), rehearsed on CPU ranks: the same
sections run (device work, the engine bench through the CLI), the report is written and
says what ran; on a machine without CUDA the cuda run refuses with exit code 2."""
from __future__ import annotations

import json

import pytest

from benchmarks import gpu_check


def test_the_rehearsal_writes_a_report_of_every_section(tmp_path, capsys) -> None:
    code = gpu_check.main(["--device", "cpu", "--model", "tiny-gpt", "--gpus", "2", "--skip-stack",
                           "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["machine"]["device"] == "cpu"
    work = report["device_work"]
    assert work["state_bytes"] > 0 and work["digest_gbps"] > 0 and work["pack_unpack_gbps"] > 0
    engine = report["engine"]
    assert engine["bitexact"] is True and engine["world"] == 2 and engine["src"] == "dp=1" and engine["dst"] == "dp=2"
    assert engine["command"].startswith("dynaplane bench switch --model tiny-gpt --world 2")
    assert report["stack"] == {"skipped": "--skip-stack"}
    text = (tmp_path / "report.md").read_text()
    assert "## Engine (gloo)" in text and "bit-exact True" in text


def test_one_gpu_skips_what_needs_two_and_says_why() -> None:
    assert "needs 2" in gpu_check.engine("tiny-gpt", "cuda", 1)["skipped"]
    assert "needs 2" in gpu_check.stack_resize("tiny-gpt", "cuda", 1)["skipped"]


def test_without_cuda_the_device_run_refuses(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert not (tmp_path / "report.json").exists()
