"""The architecture of a model as its hyper-parameters: what the catalog names, what a
Hugging Face config.json is read into (hf_config.py), and what the trainer builds modules
from. Plain frozen dataclasses, nothing else."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """A decoder-only LLM. style "llama": RMSNorm, SwiGLU, RoPE; "gpt": LayerNorm+bias, GELU, learned positions."""

    style: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width (GPT: 4*hidden); unused when every layer is MoE
    vocab: int
    tied: bool = False
    positions: int = 0  # rows of the learned position table (gpt style only)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    dense_layers: frozenset[int] = field(default_factory=frozenset)  # MoE models: layers with a dense MLP

    def is_moe_layer(self, i: int) -> bool:
        return self.experts > 0 and i not in self.dense_layers


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A ViT tower (pre-LN, class token, learned positions) plus a 2-layer MLP projector into the LLM."""

    hidden: int
    layers: int
    heads: int
    mlp: int
    patch: int
    image: int
    channels: int
    proj_out: int  # the LLM's hidden size

    @property
    def positions(self) -> int:
        return (self.image // self.patch) ** 2 + 1  # patches + class token


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    family: str
    llm: DecoderConfig
    encoder: VisionConfig | None = None
    description: str = ""
