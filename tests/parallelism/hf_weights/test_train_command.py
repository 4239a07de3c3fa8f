"""`dynaplane train --init-from HF_DIR --export HF_DIR`: Hugging Face weights in and out of the CLI
trainer, across ranks: unchanged with --steps 0, trained on a dataset otherwise."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.parallelism.datasets.conftest import make_dataset
from tests.parallelism.hf_weights.test_export import assert_byte_identical
from tests.parallelism.hf_weights.tiny_hf import VOCAB, hf_logits, tokens

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynaplane", "train", "--seq", "16", *args],
                          capture_output=True, text=True, timeout=200)


def test_steps_zero_loads_and_exports_byte_identical_across_ranks(hf_dir, tmp_path: Path) -> None:
    source = hf_dir("llama")  # a sharded save
    out = _train("--init-from", source, "--export", str(tmp_path / "out"), "--layout", "tp=2", "--steps", "0")
    assert out.returncode == 0, out.stderr
    assert "exported the weights after step 0" in out.stdout
    assert_byte_identical(source, str(tmp_path / "out"))


def test_trained_on_a_dataset_the_export_loads_in_transformers(hf_dir, tmp_path: Path) -> None:
    source = hf_dir("qwen2")
    rng = np.random.default_rng(0)
    data = make_dataset(tmp_path / "d", [rng.integers(1, VOCAB, 60).tolist() for _ in range(30)], vocab=VOCAB)
    out = _train("--init-from", source, "--export", str(tmp_path / "out"), "--layout", "dp=2,zero=1",
                 "--steps", "3", "--dataset", str(data), "--global-batch", "4")
    assert out.returncode == 0, out.stderr
    x = tokens()
    before, after = hf_logits(source, x), hf_logits(str(tmp_path / "out"), x)
    assert torch.isfinite(after).all() and not torch.allclose(before, after)


def test_bad_weights_are_refused_before_any_rank_starts(hf_dir, tmp_path: Path) -> None:
    out = _train("--init-from", hf_dir("llama"), "--model", "tiny-gpt", "--layout", "dp=1", "--steps", "1")
    assert out.returncode == 2 and "config.json" in out.stderr, out.stderr
    out = _train("--init-from", str(tmp_path / "none"), "--layout", "dp=1", "--steps", "1")
    assert out.returncode == 2 and "none" in out.stderr, out.stderr
    out = _train("--layout", "dp=1", "--steps", "0")
    assert out.returncode == 2 and "0 only with --init-from and --export" in out.stderr
