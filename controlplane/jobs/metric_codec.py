"""Packing of metric samples for the compact store: float64 arrays as bytes (stdlib
array, little-endian), so one row holds up to CHUNK_POINTS samples."""
from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

CHUNK_POINTS = 1024


def pack(values: Sequence[float]) -> bytes:
    data = array("d", values)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def unpack(blob: bytes) -> list[float]:
    data = array("d")
    data.frombytes(bytes(blob))
    if sys.byteorder != "little":
        data.byteswap()
    return data.tolist()
