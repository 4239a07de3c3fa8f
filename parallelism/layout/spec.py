"""Layout strings (docs/contracts.md section 1): parse, validate, print canonically.

Examples::

    tp=8,pp=4,dp=4,zero=1
    tp=8,pp=8,dp=16,ep=8,zero=1
    encoder:tp=1,dp=32;llm:tp=8,pp=2,dp=2
    encoder:tp=2,dp=4,ranks=0-7;llm:tp=8,pp=2,dp=2,ranks=8-39

Only the model-independent rules live here (divisibility by head counts, layer counts
and expert counts needs the model and is checked where the model is known).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from parallelism.layout.errors import LayoutError, require

_INT_KEYS = ("tp", "pp", "vpp", "dp", "cp", "ep", "zero")
_MODULE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_RANKS_RE = re.compile(r"^([0-9]{1,6})-([0-9]{1,6})$")
_DEGREE_RE = re.compile(r"^[0-9]{1,6}$")  # ASCII digits only: str.isdigit() also takes '１' and '²'
DEFAULT_MODULE = "model"
# The largest world a layout may span. Bounds every computation that follows from a layout
# string (plans, placements, emulations) before any of it starts.
MAX_WORLD = 65536


@dataclass(frozen=True, slots=True)
class ModuleLayout:
    """One module's parallel degrees and, when not colocated, its rank range."""

    module: str = DEFAULT_MODULE
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    first_rank: int | None = None  # None: colocated, starts at rank 0

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "vpp", "dp", "cp", "ep"):
            value = getattr(self, key)
            require(isinstance(value, int) and value >= 1, f"{key}={value} must be a positive integer")
        require(self.zero in (0, 1, 2, 3), f"zero={self.zero} must be 0, 1, 2 or 3")
        require(self.vpp == 1 or self.pp > 1, f"vpp={self.vpp} needs pp > 1 (pp={self.pp})")
        require(
            (self.dp * self.cp) % self.ep == 0,
            f"ep={self.ep} must divide dp*cp={self.dp * self.cp} (dp={self.dp}, cp={self.cp})",
        )
        require(self.first_rank is None or self.first_rank >= 0, f"first rank {self.first_rank} < 0")

    @property
    def world(self) -> int:
        """Ranks this module spans: tp*pp*dp*cp."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def offset(self) -> int:
        return self.first_rank or 0

    @property
    def last_rank(self) -> int:
        return self.offset + self.world - 1

    def to_string(self, with_module: bool) -> str:
        parts = [f"{key}={getattr(self, key)}" for key in _INT_KEYS if getattr(self, key) != (0 if key == "zero" else 1)]
        if not parts:
            parts = ["tp=1"]
        if self.first_rank is not None:
            parts.append(f"ranks={self.first_rank}-{self.last_rank}")
        body = ",".join(parts)
        return f"{self.module}:{body}" if with_module else body


@dataclass(frozen=True, slots=True)
class Layout:
    """A whole job's layout: one module (homogeneous) or several (heterogeneous)."""

    modules: tuple[ModuleLayout, ...]

    def __post_init__(self) -> None:
        require(len(self.modules) >= 1, "a layout needs at least one module")
        names = [m.module for m in self.modules]
        require(len(set(names)) == len(names), f"module names repeat: {names}")
        placed = [m.first_rank is not None for m in self.modules]
        if len(self.modules) > 1:
            require(
                all(placed) or not any(placed),
                "give ranks= for every module (non-colocated) or for none (colocated)",
            )
        if not any(placed):
            worlds = {m.module: m.world for m in self.modules}
            require(
                len(set(worlds.values())) == 1,
                f"colocated modules must span the same number of ranks: {worlds}",
            )
        else:
            spans = sorted((m.offset, m.last_rank, m.module) for m in self.modules)
            for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
                require(b0 > a1, f"rank ranges overlap: {an} {a0}-{a1} and {bn} {b0}-{b1}")

    @property
    def world(self) -> int:
        """Ranks 0..world-1 exist in this layout's world."""
        return max(m.last_rank for m in self.modules) + 1

    def check_world(self) -> None:
        require(self.world <= MAX_WORLD, f"the layout spans {self.world} GPUs; at most {MAX_WORLD} are supported")

    @property
    def is_heterogeneous(self) -> bool:
        return len(self.modules) > 1

    def module(self, name: str) -> ModuleLayout:
        for m in self.modules:
            if m.module == name:
                return m
        raise LayoutError(f"layout has no module {name!r}; it has {[m.module for m in self.modules]}")

    def __str__(self) -> str:
        with_names = self.is_heterogeneous or self.modules[0].module != DEFAULT_MODULE
        return ";".join(m.to_string(with_names) for m in self.modules)


def _parse_module(text: str, module: str) -> ModuleLayout:
    require(text.strip() != "", f"module {module!r} has an empty layout")
    values: dict[str, int] = {}
    first_rank: int | None = None
    last_rank: int | None = None
    for item in text.split(","):
        key, sep, raw = (s.strip() for s in item.partition("="))
        require(sep == "=", f"{item.strip()!r} is not key=value")
        require(key not in values and not (key == "ranks" and first_rank is not None), f"key {key!r} given twice")
        if key == "ranks":
            match = _RANKS_RE.match(raw)
            require(match is not None, f"ranks={raw} is not a range a-b")
            first_rank, last_rank = int(match.group(1)), int(match.group(2))
            require(last_rank >= first_rank, f"ranks={raw} ends before it starts")
            continue
        require(key in _INT_KEYS, f"unknown key {key!r}; known keys: {', '.join(_INT_KEYS)}, ranks")
        require(raw.isdigit(), f"{key}={raw} is not a non-negative integer")
        require(bool(_DEGREE_RE.match(raw)), f"{key}={raw} must be written with the digits 0-9, at most {MAX_WORLD}")
        values[key] = int(raw)
    layout = ModuleLayout(module=module, first_rank=first_rank, **values)
    if last_rank is not None:
        require(
            last_rank - layout.offset + 1 == layout.world,
            f"ranks={first_rank}-{last_rank} holds {last_rank - layout.offset + 1} ranks but "
            f"tp*pp*dp*cp={layout.world}",
        )
    return layout


def parse_layout(text: str) -> Layout:
    """Parse a layout string; raise LayoutError naming the broken rule and its values."""
    require(isinstance(text, str) and text.strip() != "", "layout string is empty")
    sections = [s.strip() for s in text.strip().split(";")]
    modules = []
    for section in sections:
        name, sep, body = section.partition(":")
        if not sep:
            require(len(sections) == 1, f"section {section!r} of a multi-module layout needs 'module:'")
            name, body = DEFAULT_MODULE, section
        name = name.strip()
        require(bool(_MODULE_RE.match(name)), f"module name {name!r} must be lowercase letters, digits, '_'")
        modules.append(_parse_module(body, name))
    layout = Layout(tuple(modules))
    layout.check_world()
    return layout
