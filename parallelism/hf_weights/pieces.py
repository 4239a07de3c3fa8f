"""Where a logical tensor lives in a Hugging Face state dict: pure data, no torch.

A logical tensor (the catalog's name and shape) is one `Piece`, or one Piece per expert
(a per-expert checkpoint's `experts.<e>.*` tensors stacked along our dim 0). A Piece is a
region of one HF tensor: the whole tensor, or a [start, stop) range of one of its dims (a
fused tensor: GPT-2's c_attn holds q, k and v side by side, a fused MoE checkpoint's
gate_up_proj holds gate then up), transposed when HF stores the weight as (in, out)
(GPT-2's Conv1D). The same data drives both directions: reading a box of the logical
tensor out of HF regions (load) and writing HF tensors from logical ones (export).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

Range = tuple[int, int]  # [start, stop) along one dim


@dataclass(frozen=True, slots=True)
class Piece:
    """logical[expert] (the whole logical tensor when expert is None) == region of `hf_name`
    (dim `dim` cut to [start, stop), every dim whole when dim is None), transposed if `transpose`."""

    hf_name: str
    hf_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0
    transpose: bool = False
    expert: int | None = None

    @property
    def region_shape(self) -> tuple[int, ...]:
        """The shape of the HF region (in HF's dim order)."""
        shape = list(self.hf_shape)
        if self.dim is not None:
            shape[self.dim] = self.stop - self.start
        return tuple(shape)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The shape this piece has in our tensor (one expert's slice for a per-expert piece)."""
        shape = self.region_shape
        return shape[::-1] if self.transpose else shape

    def hf_ranges(self, ranges: Iterable[Range]) -> tuple[Range, ...]:
        """The HF region (per HF dim) of the box `ranges` of this piece's logical shape."""
        out = list(ranges)
        if self.transpose:
            out.reverse()
        if self.dim is not None:
            a, b = out[self.dim]
            out[self.dim] = (a + self.start, b + self.start)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Variant:
    """How a checkpoint of one model_type spells its tensors: `prefix` of GPT-2's names
    ("transformer." as save_pretrained writes; "" in the original openai-community/gpt2),
    `experts` "per_expert" (experts.<e>.w1 / gate_proj ..., save_pretrained's and the Hub's) or
    "fused" (experts.gate_up_proj and experts.down_proj, transformers 5's in-memory layout)."""

    prefix: str = ""
    experts: str = "per_expert"


@dataclass(frozen=True)
class HFMap:
    """Every logical tensor of a model as Pieces of a Hugging Face state dict, plus the HF
    names a checkpoint may hold that carry nothing we load (`ignored`, regular expressions:
    buffers such as rotary_emb.inv_freq, a tied model's redundant lm_head.weight)."""

    model_type: str
    variant: Variant
    pieces: dict[str, tuple[Piece, ...]]
    ignored: tuple[str, ...] = field(default=())

    def logical_shape(self, name: str) -> tuple[int, ...]:
        first = self.pieces[name][0]
        if first.expert is None:
            return first.logical_shape
        return (len(self.pieces[name]), *first.logical_shape)

    @property
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the map reads or writes, in the order of the logical tensors."""
        out: dict[str, tuple[int, ...]] = {}
        for pieces in self.pieces.values():
            for p in pieces:
                out.setdefault(p.hf_name, p.hf_shape)
        return out

    def by_hf_name(self) -> dict[str, list[tuple[str, Piece]]]:
        """HF name -> the (logical name, piece) pairs that make it up."""
        out: dict[str, list[tuple[str, Piece]]] = {}
        for name, pieces in self.pieces.items():
            for p in pieces:
                out.setdefault(p.hf_name, []).append((name, p))
        return out

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.search(pattern, hf_name) for pattern in self.ignored)
