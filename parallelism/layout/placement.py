"""A layout resolved against a model: per-module layouts checked against the model's
head, layer and expert counts, and which pipeline stages hold each tensor.

Pipeline split (docs/contracts.md section 2): L layers cut into pp*vpp contiguous chunks, the
first L % (pp*vpp) chunks one layer longer; chunk c belongs to stage c % pp. Example:
L=10, pp=4, vpp=1 -> chunk sizes 3,3,2,2 -> layers 0-2 on stage 0, 3-5 on 1, 6-7 on 2,
8-9 on 3. With vpp=2 (8 chunks of 2,2,1,1,1,1,1,1): stage 0 holds layers 0-1 and 6.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from parallelism.layout.errors import LayoutError, require
from parallelism.layout.spec import DEFAULT_MODULE, Layout, ModuleLayout, parse_layout
from parallelism.layout.tensors import Model, ModuleSpec, TensorSpec


def layer_stages(num_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """Stage of every layer, Megatron's interleaved cut."""
    chunks = pp * vpp
    base, extra = divmod(num_layers, chunks)
    stages: list[int] = []
    for chunk in range(chunks):
        stages += [chunk % pp] * (base + (1 if chunk < extra else 0))
    return tuple(stages)


def _check_module(module: ModuleSpec, ml: ModuleLayout) -> None:
    tp, name = ml.tp, module.name
    require(module.num_heads % tp == 0, f"tp={tp} does not divide {module.num_heads} attention heads ({name})")
    kv = module.num_kv_heads
    require(kv % tp == 0 or tp % kv == 0,
             f"tp={tp} and {kv} kv heads: one must divide the other ({name})")
    require(ml.pp * ml.vpp <= module.num_layers,
             f"pp*vpp={ml.pp * ml.vpp} exceeds the {module.num_layers} layers of {name}")
    if module.num_experts:
        require(module.num_experts % ml.ep == 0, f"ep={ml.ep} does not divide {module.num_experts} experts ({name})")
    else:
        require(ml.ep == 1, f"ep={ml.ep} but {name} has no experts")


def hetero_refusal(placement: "Placement") -> str | None:
    """Why the heterogeneous trainer (parallelism/training/hetero.py) cannot run this placement of
    a multimodal model, or None; one pure rule for the trainer and the control plane, which
    refuses such a job or resize up front. Batch divisibility is checked apart (batch_dp)."""
    for name, ml in placement.modules.items():
        if ml.ep != 1:
            return (f"{name}: ep={ml.ep}; the heterogeneous trainer supports tp, pp, dp and zero 0-3 (vpp and cp "
                    f"in the LLM), so ep must be 1")
    encoder = placement.modules.get("encoder")
    if encoder is not None and encoder.pp != 1:
        return f"encoder: pp={encoder.pp}; the encoder runs unpipelined (give it more dp instead)"
    if encoder is not None and encoder.cp != 1:
        return (f"encoder: cp={encoder.cp}; the encoder attends over each image's tokens whole (context "
                f"parallelism splits the LLM's image + text sequence only), so cp must be 1")
    return None


def batch_dp(placement: "Placement") -> int:
    """The data parallelism the global batch is cut over: the last module's (the LLM, which
    reads the text and computes the loss; an encoder's dp only splits its own work)."""
    return placement.modules[placement.model.modules[-1].name].dp


@dataclass(frozen=True)
class Placement:
    """Model + layout: every module's layout, validated."""

    model: Model
    layout: Layout
    modules: dict[str, ModuleLayout]

    @property
    def world(self) -> int:
        return max(ml.offset + ml.world for ml in self.modules.values())

    @cached_property
    def _stages(self) -> dict[str, tuple[int, ...]]:
        return {m.name: layer_stages(m.num_layers, self.modules[m.name].pp, self.modules[m.name].vpp)
                for m in self.model.modules}

    def tensor_stages(self, tensor: TensorSpec) -> tuple[int, ...]:
        """Pipeline stages of its module that hold the tensor."""
        split, ml = tensor.split, self.modules[tensor.split.module]
        if split.layer is not None:
            return (self._stages[split.module][split.layer],)
        return {"first": (0,), "last": (ml.pp - 1,), "first+last": tuple(sorted({0, ml.pp - 1}))}[split.place]


def place(model: Model, layout: Layout | str) -> Placement:
    """Resolve a layout for a model; LayoutError names the broken rule and the values.

    A layout without module names applies to every module of the model (colocated);
    otherwise it must name exactly the model's modules.
    """
    parsed = parse_layout(layout) if isinstance(layout, str) else layout
    names = [m.name for m in model.modules]
    if len(parsed.modules) == 1 and parsed.modules[0].module == DEFAULT_MODULE:
        base = parsed.modules[0]
        modules = {n: ModuleLayout(n, base.tp, base.pp, base.vpp, base.dp, base.cp, base.ep, base.zero,
                                   base.first_rank) for n in names}
    else:
        given = [m.module for m in parsed.modules]
        if sorted(given) != sorted(names):
            raise LayoutError(f"layout names modules {given} but {model.name} has modules {names}")
        modules = {m.module: m for m in parsed.modules}
    for module in model.modules:
        _check_module(module, modules[module.name])
    return Placement(model, parsed, modules)


def tp_block(placement: Placement) -> int:
    """Ranks that must share a node: every module's TP groups (tp consecutive ranks from its
    offset) fit in aligned blocks of lcm(tp), e.g. encoder tp=2 + llm tp=4 -> blocks of 4.
    When a module's offset breaks the alignment, the whole world is one block."""
    modules = placement.modules.values()
    block = math.lcm(*(ml.tp for ml in modules))
    if placement.world % block or any(ml.offset % ml.tp for ml in modules):
        return placement.world
    return block
