"""Region reads of safetensors files against safetensors' own get_slice (the oracle)."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from parallelism.hf_weights import region_read
from parallelism.hf_weights.errors import HFWeightsError
from parallelism.hf_weights.region_read import SafetensorsFile, row_span


@st.composite
def regions(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    ranges = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        ranges.append((a, draw(st.integers(a + 1, n))))
    return shape, tuple(ranges), draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regions(), st.sampled_from([1, 16, 1 << 20]))
def test_a_region_read_equals_safetensors_get_slice(tmp_path, monkeypatch, case, chunk) -> None:
    shape, ranges, dtype = case
    monkeypatch.setattr(region_read, "CHUNK_BYTES", chunk)  # strided regions read a row (or more) at a time
    path = str(tmp_path / "w.safetensors")
    g = torch.Generator().manual_seed(len(shape) * 100 + sum(shape))
    tensors = {"before": torch.randn(3, generator=g), "w": torch.randn(shape, generator=g).to(dtype),
               "after": torch.randn(2, 2, generator=g).to(torch.bfloat16)}
    save_file(tensors, path)
    f = SafetensorsFile(path)
    scratch: list[torch.Tensor] = []
    try:
        got = f.region("w", ranges, scratch)
        again = f.region("w", ranges, scratch)  # the scratch buffer reused: the first result is its own tensor
    finally:
        f.close()
    with safe_open(path, framework="pt") as oracle:
        want = oracle.get_slice("w")[tuple(slice(a, b) for a, b in ranges)]
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want) and torch.equal(again, want)
    assert got.untyped_storage().data_ptr() != again.untyped_storage().data_ptr()


def test_the_row_span_of_a_region() -> None:
    assert row_span((4, 6), 2, ((1, 3), (0, 6))) == (12, 36, True)
    assert row_span((4, 6), 2, ((1, 3), (2, 4))) == (12, 36, False)
    assert row_span((5,), 4, ((2, 5),)) == (8, 20, True)


def test_a_truncated_file_is_named(tmp_path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(HFWeightsError, match=r"w.safetensors: w's data ends at byte \d+ but the file has \d+ bytes"):
        SafetensorsFile(str(path))
