"""Logical tensors of a model: name, global (unsharded) shape and how a layout splits it.

The split fields are docs/contracts.md section 3's `split` object; section 2 says what they mean.
Example: llama3-8b's ``llm.layers.3.attn.k.weight`` has shape (1024, 4096) and split
``TensorSplit(module="llm", layer=3, place=None, tp_dim=0, tp_units=8, ep_dim=None)``:
TP splits dim 0 by the 8 kv heads, so with tp=16 every head is held by two TP ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from parallelism.layout.errors import require

Place = Literal["first", "last", "first+last"]
STATES: tuple[str, ...] = ("param", "master", "exp_avg", "exp_avg_sq")
STATE_BYTES: dict[str, int] = {"param": 2, "master": 4, "exp_avg": 4, "exp_avg_sq": 4}


@dataclass(frozen=True, slots=True)
class TensorSplit:
    module: str
    layer: int | None
    place: Place | None
    tp_dim: int | None
    tp_units: int | None
    ep_dim: int | None

    def __post_init__(self) -> None:
        require((self.layer is None) != (self.place is None), f"exactly one of layer/place: {self}")
        require(self.ep_dim in (None, 0), f"ep_dim must be 0 or None: {self}")
        require(self.tp_units is None or self.tp_dim is not None, f"tp_units without tp_dim: {self}")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    split: TensorSplit

    def __post_init__(self) -> None:
        require(len(self.shape) >= 1 and all(n >= 1 for n in self.shape), f"{self.name}: bad shape {self.shape}")
        if self.split.tp_dim is not None:
            require(self.split.tp_dim < len(self.shape), f"{self.name}: tp_dim {self.split.tp_dim} >= ndim")
            if self.split.tp_units:
                require(self.shape[self.split.tp_dim] % self.split.tp_units == 0,
                         f"{self.name}: dim {self.split.tp_dim} ({self.shape[self.split.tp_dim]}) "
                         f"not a multiple of {self.split.tp_units} units")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_expert(self) -> bool:
        return self.split.ep_dim is not None


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    """What layout validation needs to know about one module (e.g. "llm", "encoder")."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int = 0  # 0: dense


@dataclass(frozen=True, slots=True)
class Model:
    """A model: its modules and every logical tensor, in the global order all ranks use."""

    name: str
    family: str
    modules: tuple[ModuleSpec, ...]
    tensors: tuple[TensorSpec, ...]
    description: str = ""

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        require(len(set(names)) == len(names), f"{self.name}: duplicate tensor names")
        known = {m.name for m in self.modules}
        for t in self.tensors:
            require(t.split.module in known, f"{t.name}: unknown module {t.split.module!r}")

    @property
    def param_count(self) -> int:
        return sum(t.numel for t in self.tensors)

    def module(self, name: str) -> ModuleSpec:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)
