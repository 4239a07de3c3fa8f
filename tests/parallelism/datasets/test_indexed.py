"""Megatron's indexed format: what we write is the documented byte layout, what we read is checked."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from parallelism.datasets.errors import DatasetError
from parallelism.datasets.indexed import IndexedDataset, IndexedWriter


def write(prefix, docs, dtype=np.uint16):
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add(d)
    return IndexedDataset(prefix)


def test_written_bytes_are_the_megatron_layout(tmp_path):
    """The oracle is the layout spelled out by hand (megatron/core/datasets/indexed_dataset.py)."""
    write(tmp_path / "d", [[5, 6, 7], [1], [9, 9]])
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", 3)
                + struct.pack("<Q", 4) + struct.pack("<3i", 3, 1, 2) + struct.pack("<3q", 0, 6, 8)
                + struct.pack("<4q", 0, 1, 2, 3))
    assert (tmp_path / "d.idx").read_bytes() == expected
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<6H", 5, 6, 7, 1, 9, 9)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 200, size=n) for n in (1, 17, 0, 300, 5)]
    data = write(tmp_path / "d", docs, dtype)
    assert len(data) == 5 and data.tokens == sum(map(len, docs))
    for i, d in enumerate(docs):
        assert np.array_equal(data.sequence(i), d)
    assert data.max_token() == max(int(d.max()) for d in docs if len(d))


def _corrupt(tmp_path, mutate):
    write(tmp_path / "d", [[1, 2, 3], [4, 5]])
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    (tmp_path / "d.idx").write_bytes(bytes(mutate(raw)))
    with pytest.raises(DatasetError) as info:
        IndexedDataset(tmp_path / "d")
    return str(info.value)


def test_corrupt_index_is_refused_naming_the_file_and_the_rule(tmp_path):
    assert "d.idx: not a Megatron index" in _corrupt(tmp_path, lambda b: b"XXIDIDX\x00\x00" + b[9:])
    assert "version 2" in _corrupt(tmp_path, lambda b: b[:9] + struct.pack("<Q", 2) + b[17:])
    assert "dtype code 7" in _corrupt(tmp_path, lambda b: b[:17] + bytes([7]) + b[18:])
    assert "truncated or corrupt" in _corrupt(tmp_path, lambda b: b[:-4])
    assert "pointers" in _corrupt(tmp_path, lambda b: b[:34 + 8] + struct.pack("<q", 2) + b[34 + 16:])
    assert "document indices" in _corrupt(tmp_path, lambda b: b[:-8] + struct.pack("<q", 7))


def test_truncated_or_foreign_bin_is_refused(tmp_path):
    write(tmp_path / "d", [[1, 2, 3], [4, 5]])
    bin_path = tmp_path / "d.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DatasetError, match=r"d.bin: 8 bytes, its index d.idx describes 10"):
        IndexedDataset(tmp_path / "d")
    bin_path.unlink()
    with pytest.raises(DatasetError, match="d.bin: missing"):
        IndexedDataset(tmp_path / "d")
