"""Read regions of tensors out of safetensors files with large positional reads.

Why not safetensors' `get_slice`: it reads through a memory map of the file, and on a file
that is not in the page cache every 4 KiB page is a fault that reads a small window of the
file. Four ranks loading a 1.1B checkpoint that way spent 42 s of kernel CPU against 11 s
for the same load from the page cache (docs/benchmarks.md, "HF weights"); `os.preadv` of
whole row spans lets the kernel read ahead in large requests and copies straight into the
destination tensor.

The file format is safetensors' own (an 8-byte little-endian header length, a JSON header
with each tensor's dtype, shape and [begin, end) data offsets, then the data); the header
was already checked by safetensors when the directory was opened (hf_files.read_header),
and each tensor's span is checked against the file's size again here.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence

import torch
from torch import Tensor

from parallelism.hf_weights.errors import HFWeightsError
from parallelism.hf_weights.pieces import Range

TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
CHUNK_BYTES = 64 << 20  # rows of a strided region are read through a buffer of about this size


def row_span(shape: Sequence[int], itemsize: int, ranges: Sequence[Range]) -> tuple[int, int, bool]:
    """(first byte, end byte) of the rows `ranges[0]` of a row-major tensor, relative to its
    data, and whether the region is exactly that span (every later dim whole)."""
    row = math.prod(shape[1:]) * itemsize
    (a, b), rest = ranges[0], ranges[1:]
    whole = all(r == (0, n) for r, n in zip(rest, shape[1:]))
    return a * row, b * row, whole


class SafetensorsFile:
    """One open safetensors file: each tensor's absolute byte span, dtype and shape."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.entries = self._entries()
        except BaseException:
            os.close(self.fd)
            raise

    def _entries(self) -> dict[str, tuple[int, int, str, tuple[int, ...]]]:
        """name -> (absolute first byte, end byte, dtype, shape), each span inside the file."""
        path, size = self.path, os.fstat(self.fd).st_size
        (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        if 8 + n > size:
            raise HFWeightsError(f"{path}: its header of {n} bytes runs past the end of the file ({size} bytes)")
        header = json.loads(os.pread(self.fd, n, 8))
        entries: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if 8 + n + end > size:
                raise HFWeightsError(f"{path}: {name}'s data ends at byte {8 + n + end} but the file has {size} "
                                     "bytes (truncated)")
            entries[name] = (8 + n + begin, 8 + n + end, entry["dtype"], tuple(entry["shape"]))
        return entries

    def close(self) -> None:
        os.close(self.fd)

    def read_into(self, out: Tensor, offset: int) -> None:
        """Fill the contiguous tensor `out` with the file's bytes from `offset`."""
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise HFWeightsError(f"{self.path}: ended at byte {offset + done} while reading (truncated)")
            done += got

    def region(self, name: str, ranges: Sequence[Range], scratch: list[Tensor]) -> Tensor:
        """The region `ranges` of tensor `name` in a tensor of its own (the stored dtype).
        `scratch` holds a reusable byte buffer for regions that are not one span of the file."""
        start, _, dtype_name, shape = self.entries[name]
        dtype = TORCH_DTYPES[dtype_name]
        itemsize = torch.empty((), dtype=dtype).element_size()
        out = torch.empty(tuple(b - a for a, b in ranges), dtype=dtype)
        if not shape or out.numel() == 0:
            if shape == () and out.numel():
                self.read_into(out, start)
            return out
        first, end, whole = row_span(shape, itemsize, ranges)
        if whole:
            self.read_into(out, start + first)
            return out
        row = (end - first) // (ranges[0][1] - ranges[0][0])
        rows = max(1, CHUNK_BYTES // max(row, 1))
        if not scratch or scratch[0].numel() < rows * row:
            scratch[:] = [torch.empty(min(rows, ranges[0][1] - ranges[0][0]) * row, dtype=torch.uint8)]
        inner = tuple(slice(a, b) for a, b in ranges[1:])
        for r in range(ranges[0][0], ranges[0][1], rows):
            n = min(rows, ranges[0][1] - r)
            buf = scratch[0][: n * row]
            self.read_into(buf, start + r * row)
            block = buf.view(dtype).view(n, *shape[1:])
            out[r - ranges[0][0]: r - ranges[0][0] + n].copy_(block[(slice(None), *inner)])
        return out
