"""Deterministic initialization: every tensor's value is a pure function of (seed, its logical name, its shape).

Because no generator state is shared between tensors, the values do not depend on the order tensors are
visited, on which device holds them, or on which rank builds them: a rank holding a shard can compute the
full tensor with `initial_value` and slice its box, and get the same bits as a single-process run.
"""
from __future__ import annotations

import hashlib
from typing import Literal

import torch
from torch import Tensor, nn

INIT_STD = 0.02
InitKind = Literal["normal", "ones", "zeros"]
# Last component of every norm module's name in the catalog (llama, qwen3, gpt and ViT layers).
_NORM_MODULES = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm", "pre_norm", "ln1", "ln2")


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, name); sha256 rather than Python's salted hash() so every process agrees."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def init_kind(name: str) -> InitKind:
    """How a catalog tensor starts: norm weights 1, biases 0, everything else N(0, 0.02).

    E.g. "llm.layers.3.attn.q_norm.weight" -> ones, "encoder.projector.fc1.bias" -> zeros,
    "llm.layers.3.moe.experts.gate.weight" -> normal.
    """
    parts = name.split(".")
    if parts[-1] == "bias":
        return "zeros"
    if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _NORM_MODULES:
        return "ones"
    return "normal"


def initial_value(name: str, shape: tuple[int, ...] | torch.Size, seed: int,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """The full initial value of one logical tensor, on the CPU (CPU generators give the same bits everywhere)."""
    kind = init_kind(name)
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    generator = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
    # Drawn in float32 then cast, so a bf16 model holds exactly the cast of the fp32 model's values.
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * INIT_STD).to(dtype)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Set every parameter of `model` (named from the model's root, e.g. "llm.embed.weight") to its initial value.

    Parameters on the meta device are skipped: there is nothing to fill until `model.to_empty(device=...)`.
    """
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        param.copy_(initial_value(name, param.shape, seed, param.dtype))
