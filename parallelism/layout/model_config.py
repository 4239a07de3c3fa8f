"""The architecture of a model as its hyper-parameters: what the catalog names, what a
Hugging Face config.json is read into (hf_config.py), and what the trainer builds modules
from. Plain frozen dataclasses, nothing else."""
from __future__ import annotations

from dataclasses import dataclass, field

ROPE_THETA = 500_000.0  # Llama 3's RoPE base: the catalog's llama-style models use it
# Activations the trainer computes, by their Hugging Face names (ACT2FN's): SiLU, exact GELU and
# GELU's tanh approximation under its three names. "" is a style's own: silu (llama), gelu_new (gpt).
ACTIVATIONS: tuple[str, ...] = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast",
                                "relu2")  # relu2: squared ReLU (Primer; Nemotron's MLP)
NORMS: tuple[str, ...] = ("rms", "layernorm")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A config's non-default RoPE (`rope_parameters` / `rope_scaling`). rope_type "llama3" (Llama 3.1+)
    is computed as transformers does; other types are recorded so the weight loader can refuse them."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


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
    # Numerics a Hugging Face checkpoint fixes (hf_config.py reads them); the defaults are the catalog's.
    rope_theta: float = ROPE_THETA  # RoPE base (llama style)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    norm_eps: float = 1e-5  # RMSNorm / LayerNorm epsilon
    norm_topk_prob: bool = True  # MoE: renormalize the top-k gates to sum to 1 (Mixtral; Qwen3-MoE's flag)
    hidden_act: str = ""  # "": the style's own, silu (llama) or gelu_new, GELU's tanh form (gpt)
    # llama style: a gated MLP down(act(gate(x)) * up(x)), or without a gate down(act(up(x)))
    # (Nemotron: squared ReLU); its norms RMSNorm or LayerNorm with a bias (Nemotron's
    # LayerNorm1P computes weight + 1: the same function of a shifted stored weight); RoPE on
    # the first `rotary_dim` dims of each head (0: all of them; Nemotron rotates half).
    gated_mlp: bool = True
    norm: str = "rms"
    rotary_dim: int = 0
    # Sliding-window attention (Mistral, Qwen2's optional window, GPT-OSS's alternate layers):
    # the layers in `window_layers` attend to the last `sliding_window` keys only.
    sliding_window: int = 0
    window_layers: frozenset[int] = field(default_factory=frozenset)
    # GPT-OSS: a learned sink logit per attention head (window_attention.py); biases on the
    # router and the experts; its SwiGLU clamped (gate <= limit, |up| <= limit) as
    # (up + 1) * gate * sigmoid(alpha * gate) when swiglu_limit > 0.
    attention_sinks: bool = False
    moe_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    def layer_window(self, i: int) -> int:
        """Keys a query of layer i attends to at most (0: every earlier key)."""
        return self.sliding_window if i in self.window_layers else 0

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

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
