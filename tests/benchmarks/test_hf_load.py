"""benchmarks/hf_load.py at a tiny scale: a ~0.7M-parameter Llama checkpoint written without
transformers, which the loader accepts, its disk reads and every timed run on 2 ranks
(posix_fadvise evicts the files alone: a test never drops the whole machine's page cache),
the report's RESULT line, the cache and the refusals."""
from __future__ import annotations

import json
import os
from collections import namedtuple

import pytest

from benchmarks import hf_load
from parallelism.hf_weights import read_hf_tensors

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_the_full_size_model_is_tinyllamas_1_1b() -> None:
    assert hf_load.param_count(hf_load.MODELS["tinyllama-1.1b"]) == 1_100_048_384
    plan = hf_load.shard_plan(hf_load.MODELS["tinyllama-1.1b"], hf_load.SHARD_BYTES["tinyllama-1.1b"])
    assert len(plan) == 3 and all(sum(2 * n for n in (_numel(s) for _, s in f)) <= 2**30 for f in plan)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def test_tiny_checkpoint_loads_and_every_run_reports(tmp_path, capsys) -> None:
    hf_dir, built = hf_load.build_checkpoint(str(tmp_path), "tiny")
    assert built and hf_load.build_checkpoint(str(tmp_path), "tiny") == (hf_dir, False)  # cached
    files = hf_load.shard_files(hf_dir)
    assert len(files) == 2  # sharded, with an index
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == 2 * hf_load.param_count(hf_load.MODELS["tiny"])
    hf_load.check_loadable(hf_dir, "dp=2,zero=1")
    tensors = read_hf_tensors(hf_dir, dtype=None)
    assert tensors["llm.embed.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert tensors["llm.final_norm.weight"].eq(1).all()

    n = hf_load.param_count(hf_load.MODELS["tiny"])
    m = hf_load.measure(hf_dir, "fadvise", world=2, layout="dp=2,zero=1")
    assert m["method"] == "fadvise" and m["bytes"] == sum(os.path.getsize(f) for f in files)
    for name in hf_load.RUNS:
        run = m[name]
        assert len(run.ranks) == 2 and run.seconds > 0 and m[f"{name}_ratio"] > 0
        # dp=2, ZeRO-1: each rank holds the whole bf16 params, half the fp32 master and moments
        assert all(r["state_bytes"] == 2 * n + 12 * n // 2 for r in run.ranks)
        if hf_load.RUNS[name][0] == "load":
            assert all(r["param_bytes"] == m["bytes"] - _header_bytes(files) for r in run.ranks)
    assert m["cold"].resident is None or 0 <= m["cold"].resident <= 1
    hf_load.report(m, "tiny")
    out = capsys.readouterr().out
    assert "RESULT hf_load tiny dp=2,zero=1: cold load" in out and "into pre-faulted memory" in out


def _header_bytes(files: list[str]) -> int:
    total = 0
    for file in files:
        with open(file, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def test_an_unfinished_build_is_redone(tmp_path) -> None:
    hf_dir, _ = hf_load.build_checkpoint(str(tmp_path), "tiny")
    os.remove(os.path.join(hf_dir, hf_load.COMPLETE))
    os.remove(hf_load.shard_files(hf_dir)[0])
    assert hf_load.build_checkpoint(str(tmp_path), "tiny") == (hf_dir, True)
    hf_load.check_loadable(hf_dir)


def test_too_little_memory_or_disk_is_refused_with_the_numbers(tmp_path, monkeypatch) -> None:
    dims = hf_load.MODELS["tinyllama-1.1b"]
    monkeypatch.setattr(hf_load, "mem_available", lambda: 8 * 2**30)
    with pytest.raises(SystemExit, match=r"needs about \d+\.\d GiB of available memory .* MemAvailable is 8\.0 GiB"):
        hf_load.check_resources(str(tmp_path), "tinyllama-1.1b", dims, None)
    monkeypatch.setattr(hf_load.shutil, "disk_usage", lambda _: namedtuple("U", "total used free")(0, 0, 2**30))
    with pytest.raises(SystemExit, match=r"checkpoint needs 2\.1 GiB of disk .* 1\.0 GiB is free"):
        hf_load.check_resources(str(tmp_path), "tinyllama-1.1b", dims, None)
