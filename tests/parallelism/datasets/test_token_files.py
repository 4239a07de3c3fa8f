"""Raw token memmaps: nanoGPT/OLMo headerless files and llm.c shards."""
from __future__ import annotations

import numpy as np
import pytest

from parallelism.datasets.errors import DatasetError
from parallelism.datasets.token_files import LLMC_MAGIC, TokenFile


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_headerless(tmp_path, dtype):
    tokens = np.arange(1000, dtype=dtype) * 7 % 50_000
    tokens.tofile(tmp_path / "train.bin")
    f = TokenFile(tmp_path / "train.bin", dtype)
    assert f.tokens == 1000 and np.array_equal(f.tokens_view, tokens)


def test_llmc_header(tmp_path):
    tokens = np.arange(300, dtype=np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (LLMC_MAGIC, 1, len(tokens))
    (tmp_path / "shard.bin").write_bytes(header.tobytes() + tokens.tobytes())
    f = TokenFile(tmp_path / "shard.bin", header="llm.c")
    assert np.array_equal(f.tokens_view, tokens)
    (tmp_path / "shard.bin").write_bytes(header.tobytes() + tokens[:-1].tobytes())
    with pytest.raises(DatasetError, match="shard.bin: header promises 300 tokens"):
        TokenFile(tmp_path / "shard.bin", header="llm.c")
    header[0] = 1
    (tmp_path / "shard.bin").write_bytes(header.tobytes() + tokens.tobytes())
    with pytest.raises(DatasetError, match="not an llm.c token shard"):
        TokenFile(tmp_path / "shard.bin", header="llm.c")


def test_odd_byte_count_is_refused(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DatasetError, match="t.bin: 3 bytes of tokens is not a whole number of uint16"):
        TokenFile(tmp_path / "t.bin", "uint16")
    with pytest.raises(DatasetError, match="token dtype 'int8' unknown"):
        TokenFile(tmp_path / "t.bin", "int8")
