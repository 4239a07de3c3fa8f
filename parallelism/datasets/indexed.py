"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read through numpy memmaps and written.

The `.idx` layout (megatron/core/datasets/indexed_dataset.py, the de facto pretraining format):
9-byte magic `MMIDIDX\\0\\0`, uint64 version (1), uint8 dtype code, uint64 sequence count S,
uint64 document-index count D+1, then int32 sequence lengths [S], int64 byte pointers into the
`.bin` [S], int64 document indices [D+1] (document d is sequences idx[d]..idx[d+1]-1; idx[0] = 0).
The `.bin` is the sequences' tokens back to back. This module reads and checks all of that before
any token is used (a truncated `.bin` or a corrupt `.idx` is refused with the file and the rule), and
writes it (`IndexedWriter`), so `dynaplane data prepare` output loads in Megatron, NeMo and friends.
We treat each sequence as one training document, as Megatron's GPTDataset does.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from parallelism.datasets.errors import DatasetError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type[np.number]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                           6: np.float64, 7: np.float32, 8: np.uint16}
TOKEN_CODES = (1, 3, 4, 5, 8)  # integer dtypes only: float "tokens" are not tokens
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8


def token_dtype(vocab_size: int) -> type[np.number]:
    """The smallest dtype Megatron's preprocess would pick: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size < 65_500 else np.int32


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise DatasetError(f"dtype {dtype} has no Megatron indexed-dataset code")


class IndexedDataset:
    """A read-only view of PREFIX.bin/.idx: `sequence(i)` is a numpy view of sequence i's tokens."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        self.idx_path, self.bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DatasetError(f"{path.name}: missing (an indexed dataset is PREFIX.bin + PREFIX.idx)")
        self._read_index()
        self._check_bin()

    def _fail(self, rule: str) -> DatasetError:
        return DatasetError(f"{self.idx_path.name}: {rule}")

    def _read_index(self) -> None:
        size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
            raise self._fail(f"not a Megatron index (it must start with {MAGIC!r} and a {HEADER_BYTES}-byte header)")
        version, code, sequences, doc_entries = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION:
            raise self._fail(f"index version {version}, only version {VERSION} exists")
        if code not in TOKEN_CODES:
            raise self._fail(f"dtype code {code} is not an integer token dtype (codes {TOKEN_CODES})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_BYTES + sequences * 4 + sequences * 8 + doc_entries * 8
        if doc_entries < 1 or size < expected:
            raise self._fail(f"holds {size} bytes, its header promises {expected} "
                             f"({sequences} sequences, {doc_entries} document entries): truncated or corrupt")
        mm = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        offset = HEADER_BYTES
        self.lengths = np.frombuffer(mm, dtype=np.int32, count=sequences, offset=offset)
        offset += sequences * 4
        self.pointers = np.frombuffer(mm, dtype=np.int64, count=sequences, offset=offset)
        offset += sequences * 8
        self.document_indices = np.frombuffer(mm, dtype=np.int64, count=doc_entries, offset=offset)
        if sequences and (self.lengths.min() < 0):
            raise self._fail("a sequence length is negative")
        doc = self.document_indices
        if doc[0] != 0 or doc[-1] != sequences or np.any(np.diff(doc) < 0):
            raise self._fail(f"document indices must rise from 0 to the sequence count {sequences}")
        if sequences:
            step = self.lengths[:-1].astype(np.int64) * self.dtype.itemsize
            if self.pointers[0] != 0 or np.any(self.pointers[1:] != self.pointers[:-1] + step):
                raise self._fail("sequence pointers must start at 0 and each follow the previous sequence")

    def _check_bin(self) -> None:
        need = int(self.lengths.astype(np.int64).sum()) * self.dtype.itemsize
        have = self.bin_path.stat().st_size
        if have != need:
            raise DatasetError(f"{self.bin_path.name}: {have} bytes, its index {self.idx_path.name} describes "
                               f"{need} ({self.tokens} tokens of {self.dtype}): truncated or not this index's data")
        self.tokens_view = (np.memmap(self.bin_path, mode="r", dtype=self.dtype) if need
                            else np.zeros(0, dtype=self.dtype))

    @property
    def tokens(self) -> int:
        return int(self.lengths.astype(np.int64).sum())

    def __len__(self) -> int:
        return len(self.lengths)

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens_view[start:start + int(self.lengths[i])]

    def max_token(self, chunk: int = 1 << 24) -> int:
        """The largest token id (one pass over the .bin, chunked)."""
        view, top = self.tokens_view, -1
        for start in range(0, len(view), chunk):
            top = max(top, int(view[start:start + chunk].max()))
        return top


class IndexedWriter:
    """Write PREFIX.bin/.idx one document at a time (`add`), the index at `close`."""

    def __init__(self, prefix: str | os.PathLike, dtype) -> None:
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        dtype_code(self.dtype)
        self.lengths: list[int] = []
        self._bin = open(self.prefix + ".bin", "wb")

    def add(self, tokens) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self.lengths.append(len(array))

    def close(self) -> None:
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * self.dtype.itemsize
        documents = np.arange(len(lengths) + 1, dtype=np.int64)  # one sequence per document
        with open(self.prefix + ".idx", "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, dtype_code(self.dtype), len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._bin.close()
