"""Tensors through an HFMap (pieces.py): a box of a logical tensor read out of HF regions,
and HF tensors assembled from logical ones. Pure tensor code, no files."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from parallelism.hf_weights.errors import HFWeightsError
from parallelism.hf_weights.pieces import HFMap, Piece, Range

# (HF name, per-dim slices) -> that region of the HF tensor, in its stored dtype.
RegionReader = Callable[[str, tuple[slice, ...]], Tensor]


def read_box(pieces: Sequence[Piece], ranges: Sequence[Range], read: RegionReader) -> Tensor:
    """The box `ranges` (one [start, stop) per logical dim) of the logical tensor made of
    `pieces`, contiguous, in the stored dtype. Per-expert pieces: dim 0 picks the experts."""
    if pieces[0].expert is None:
        (piece,) = pieces
        return _region(piece, ranges, read)
    first, last = ranges[0]
    parts = [_region(pieces[e], ranges[1:], read) for e in range(first, last)]
    if not parts:
        return torch.empty((0, *(b - a for a, b in ranges[1:])))
    return torch.stack(parts)


def _region(piece: Piece, ranges: Sequence[Range], read: RegionReader) -> Tensor:
    region = read(piece.hf_name, tuple(slice(a, b) for a, b in piece.hf_ranges(ranges)))
    return (region.t() if piece.transpose else region).contiguous()


def full_ranges(shape: Sequence[int]) -> tuple[Range, ...]:
    return tuple((0, n) for n in shape)


def from_hf(hfmap: HFMap, hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every logical tensor, whole, from a whole HF state dict (stored dtypes kept)."""
    def read(name: str, slices: tuple[slice, ...]) -> Tensor:
        return hf[name][slices]

    return {name: read_box(pieces, full_ranges(hfmap.logical_shape(name)), read)
            for name, pieces in hfmap.pieces.items()}


def hf_tensor(hf_name: str, parts: Sequence[tuple[str, Piece]], logical: Mapping[str, Tensor],
              dtype: torch.dtype) -> Tensor:
    """One HF tensor (in `dtype`) written from the logical tensors its `parts` (HFMap.by_hf_name) come from."""
    out = torch.empty(parts[0][1].hf_shape, dtype=dtype)
    covered = 0
    for name, piece in parts:
        value = logical[name] if piece.expert is None else logical[name][piece.expert]
        region = out if piece.dim is None else out.narrow(piece.dim, piece.start, piece.stop - piece.start)
        region.copy_(value.t() if piece.transpose else value)
        covered += region.numel()
    if covered != out.numel():
        raise HFWeightsError(f"{hf_name}: pieces cover {covered} of its {out.numel()} elements")
    return out


def to_hf(hfmap: HFMap, logical: Mapping[str, Tensor], dtype: torch.dtype | None = None,
          names: Sequence[str] | None = None) -> dict[str, Tensor]:
    """HF tensors (all, or `names`) from whole logical tensors; `dtype` None keeps the logical tensors' dtype."""
    parts = hfmap.by_hf_name()
    chosen = list(parts) if names is None else list(names)
    return {n: hf_tensor(n, parts[n], logical, dtype or logical[parts[n][0][0]].dtype) for n in chosen}
