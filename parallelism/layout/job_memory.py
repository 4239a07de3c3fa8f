"""Whether a training job fits its GPUs, estimated before anything runs: the largest
per-GPU model state (every tensor's param, master, exp_avg, exp_avg_sq box, as the layout
shards it) plus the activations the first pipeline stage holds.

Activations per layer and micro-batch, without recomputation or sequence parallelism, in
half-precision bytes: s*b*h*(10 + 24/t + 5*a*s/(h*t)) (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", eq. 2, with tensor parallelism t).
Under 1F1B the first stage holds up to pp micro-batches in flight, each of its layers'.
An estimate, for a clear refusal of what cannot fit (a sequence of a million tokens on a toy
model: terabytes of attention scores), not a prediction: the emulator predicts memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallelism.layout.model_config import ModelConfig
from parallelism.layout.placement import Placement, layer_stages
from parallelism.layout.shards import STATE_CLASS, holder_boxes
from parallelism.layout.tensors import STATE_BYTES, STATES


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    state_bytes: int        # the largest per-GPU model state
    activation_bytes: int   # the first stage's activations at their peak

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


def state_bytes_per_rank(placement: Placement) -> np.ndarray:
    """Bytes of model state (every tensor's param, master, exp_avg, exp_avg_sq box) per rank.
    Tensors of one geometry on the same stages have the same boxes: each is cut once."""
    out = np.zeros(placement.world)
    groups: dict[tuple, list] = {}
    for tensor in placement.model.tensors:
        split = tensor.split
        key = (tensor.shape, split.module, split.tp_dim, split.tp_units, split.ep_dim, placement.tensor_stages(tensor))
        groups.setdefault(key, [tensor, 0])[1] += 1
    per_class = {c: sum(STATE_BYTES[s] for s in STATES if STATE_CLASS[s] == c) for c in set(STATE_CLASS.values())}
    for tensor, count in groups.values():
        for state_class, nbytes in per_class.items():
            boxes = holder_boxes(placement, tensor, state_class)
            np.add.at(out, boxes.rank, boxes.size * float(nbytes * count))
    return out


def activation_bytes(config: ModelConfig, placement: Placement, micro_batch: int, seq_len: int) -> int:
    """The LLM's first pipeline stage (a multimodal model's encoder is left out)."""
    llm = config.llm
    ml = placement.modules.get("llm") or next(iter(placement.modules.values()))
    s, b, h, a, t = -(-seq_len // ml.cp), micro_batch, llm.hidden, llm.heads, ml.tp
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    first_stage_layers = layer_stages(llm.layers, ml.pp, ml.vpp).count(0)
    return int(per_layer * first_stage_layers * ml.pp)


def estimate(config: ModelConfig, placement: Placement, micro_batch: int, seq_len: int) -> MemoryEstimate:
    return MemoryEstimate(int(state_bytes_per_rank(placement).max(initial=0)),
                          activation_bytes(config, placement, micro_batch, seq_len))
