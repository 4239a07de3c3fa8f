"""Raw token files without an index: nanoGPT/OLMo-style headerless uint16 or uint32 memmaps and
llm.c's FineWeb shards (a 256 x int32 header: magic 20240520, version 1 (uint16 tokens), token count).

Such a file is one stream of tokens (documents are separated by the tokenizer's end-of-text token
inside it), so it reads as a single document; the sampler packs it like any other.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from parallelism.datasets.errors import DatasetError

RAW_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256


class TokenFile:
    """A read-only token stream: `tokens_view` is a numpy memmap of every token."""

    def __init__(self, path: str | os.PathLike, dtype: str = "uint16", header: str = "none") -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DatasetError(f"{self.path.name}: missing")
        if header not in ("none", "llm.c"):
            raise DatasetError(f"{self.path.name}: header {header!r} unknown (none or llm.c)")
        size = self.path.stat().st_size
        offset = 0
        if header == "llm.c":
            dtype = "uint16"
            head = np.fromfile(self.path, dtype=np.int32, count=LLMC_HEADER_INTS)
            if len(head) < LLMC_HEADER_INTS or head[0] != LLMC_MAGIC:
                raise DatasetError(f"{self.path.name}: not an llm.c token shard (magic {LLMC_MAGIC} in a "
                                   f"{LLMC_HEADER_INTS * 4}-byte header)")
            if head[1] != LLMC_VERSION:
                raise DatasetError(f"{self.path.name}: llm.c shard version {head[1]}, only {LLMC_VERSION} "
                                   "(uint16 tokens) is read")
            offset = LLMC_HEADER_INTS * 4
            if size - offset != int(head[2]) * 2:
                raise DatasetError(f"{self.path.name}: header promises {int(head[2])} tokens "
                                   f"({int(head[2]) * 2} bytes), the file holds {size - offset}: truncated")
        if dtype not in RAW_DTYPES:
            raise DatasetError(f"{self.path.name}: token dtype {dtype!r} unknown ({', '.join(RAW_DTYPES)})")
        self.dtype = np.dtype(RAW_DTYPES[dtype])
        if (size - offset) % self.dtype.itemsize:
            raise DatasetError(f"{self.path.name}: {size - offset} bytes of tokens is not a whole number of "
                               f"{dtype} tokens: truncated or not {dtype}")
        count = (size - offset) // self.dtype.itemsize
        self.tokens_view = (np.memmap(self.path, mode="r", dtype=self.dtype, offset=offset, shape=(count,))
                            if count else np.zeros(0, dtype=self.dtype))

    @property
    def tokens(self) -> int:
        return len(self.tokens_view)

    def max_token(self, chunk: int = 1 << 24) -> int:
        view, top = self.tokens_view, -1
        for start in range(0, len(view), chunk):
            top = max(top, int(view[start:start + chunk].max()))
        return top
