"""Transformer building blocks whose parameter names match the catalog: norms, RoPE, attention, MLPs, layers."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallelism.layout.model_config import DecoderConfig, RopeScaling
from parallelism.training.moe import MoE, clamped_swiglu
from parallelism.training.window_attention import window_attention

Factory = dict[str, Any]  # {"device": ..., "dtype": ...}: passed to every parameter's constructor
Rope = tuple[Tensor, Tensor]  # (cos, sin), each [T, head_dim], float32

NORM_EPS = 1e-5
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # one formula, 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))


def activation(name: str, style: str = "llama") -> Callable[[Tensor], Tensor]:
    """A Hugging Face activation name (model_config.ACTIVATIONS) as a function; "" is the style's own:
    silu for llama, GELU's tanh form (GPT-2's gelu_new) for gpt."""
    name = name or ("silu" if style == "llama" else "gelu_new")
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu":
        return F.gelu
    if name in _TANH_GELU:
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    raise ValueError(f"unknown activation {name!r}")


class RMSNorm(nn.Module):
    """RMSNorm with a `weight` only; normalizes in float32 so bf16 activations keep their precision."""

    def __init__(self, dim: int, fk: Factory, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **fk))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: int, head_dim: int, theta: float, device: torch.device, start: int = 0,
                 scaling: RopeScaling | None = None) -> Rope:
    """Rotary tables for positions start..start+positions-1 (a context-parallel chunk starts
    past 0), computed on the fly: no buffers, nothing to checkpoint or shard.

    Half-split layout (as Hugging Face's Llama): dims i and i + head_dim/2 rotate together by pos * theta^(-2i/hd).
    `scaling` of rope_type "llama3" rescales the frequencies as transformers' llama3 RoPE does; other
    types are not computed here (plain RoPE; the Hugging Face weight loader refuses them).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is not None and scaling.rope_type == "llama3":
        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(start, start + positions, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def llama3_frequencies(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    """Llama 3.1's long-context RoPE: wavelengths past original/low_freq_factor divided by `factor`,
    those under original/high_freq_factor kept, a smooth blend between (transformers' llama3 rope)."""
    low_wavelen = s.original_max_positions / s.low_freq_factor
    high_wavelen = s.original_max_positions / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate x [B, heads, T, head_dim] by its positions' angles; tables narrower than a head
    (partial rotary, Nemotron's) rotate its first dims and pass the rest through."""
    cos, sin = rope
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :dim], rope), x[..., dim:]), dim=-1)
    half = dim // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Multi-head attention with grouped kv heads; optional q/k/v and o biases, Qwen3's per-head q/k norms, RoPE."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, fk: Factory, *, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool = False, causal: bool = True, eps: float = NORM_EPS,
                 window: int = 0, sinks: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, head_dim, causal
        self.window = window  # a causal sliding window of this many keys (0: none)
        # Registration order q, k, v, q_norm, k_norm, o is the catalog's order, so named_parameters() follows it.
        self.q = nn.Linear(hidden, heads * head_dim, bias=qkv_bias, **fk)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias, **fk)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias, **fk)
        self.q_norm = RMSNorm(head_dim, fk, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, fk, eps) if qk_norm else None
        self.o = nn.Linear(heads * head_dim, hidden, bias=o_bias, **fk)
        # GPT-OSS: a learned logit per query head in every softmax's denominator (under tp the
        # rank's heads' slice: parallel.tp_plan shards it with the heads)
        self.sinks = nn.Parameter(torch.empty(heads, **fk)) if sinks else None
        # Context parallelism: a ContextShard (parallelism/training/context_parallel.py) whose
        # attend() gathers the sequence's keys and values; None attends over x alone.
        self.context = None

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        # -1 heads: under tensor parallelism a rank holds heads/tp query and kv_heads/tp kv heads
        # (unflatten infers them from the features alone, so an empty batch works too).
        q = self.q(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k = self.k(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.v(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3 normalizes each head before rotating it
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        gqa = self.kv_heads != self.heads
        if self.sinks is not None:
            sinks = self.sinks.to_local() if hasattr(self.sinks, "to_local") else self.sinks
            out = window_attention(q, k, v, self.window if self.window < k.shape[2] else 0, sinks)
        elif self.window and self.window < k.shape[2]:  # shorter sequences: the window holds every key
            out = window_attention(q, k, v, self.window)
        elif self.context is not None:
            out = self.context.attend(q, k, v, causal=self.causal, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=gqa)
        return self.o(out.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)) (`act` in place of silu when a config names another);
    without a gate (gated=False) down(act(up(x))), Nemotron's with squared ReLU."""

    def __init__(self, hidden: int, ffn: int, fk: Factory, *, bias: bool = False, act: str = "silu",
                 gated: bool = True) -> None:
        super().__init__()
        self.act = activation(act)
        self.gate = nn.Linear(hidden, ffn, bias=bias, **fk) if gated else None
        self.up = nn.Linear(hidden, ffn, bias=bias, **fk)
        self.down = nn.Linear(ffn, hidden, bias=bias, **fk)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is None:
            return self.down(self.act(self.up(x)))
        return self.down(self.act(self.gate(x)) * self.up(x))


def decoder_norm(c: DecoderConfig, fk: Factory) -> nn.Module:
    """A llama-style decoder's norm: RMSNorm, or LayerNorm with a bias (c.norm)."""
    if c.norm == "layernorm":
        return nn.LayerNorm(c.hidden, eps=c.norm_eps, **fk)
    return RMSNorm(c.hidden, fk, c.norm_eps)


class GeluMLP(nn.Module):
    """fc2(gelu(fc1(x))) with biases: the GPT/ViT MLP and the vision projector (whose widths differ).
    GELU's tanh form (GPT-2's gelu_new) unless `act` names another."""

    def __init__(self, d_in: int, d_mid: int, d_out: int, fk: Factory, act: str = "gelu_new") -> None:
        super().__init__()
        self.act = activation(act, "gpt")
        self.fc1 = nn.Linear(d_in, d_mid, **fk)
        self.fc2 = nn.Linear(d_mid, d_out, **fk)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LlamaBlock(nn.Module):
    """Pre-norm Llama/Qwen layer: x + attn(norm(x)), then x + mlp-or-moe(norm(x))."""

    def __init__(self, c: DecoderConfig, index: int, fk: Factory) -> None:
        super().__init__()
        self.attn_norm = decoder_norm(c, fk)
        self.attn = Attention(c.hidden, c.heads, c.kv_heads, c.head_dim, fk, qkv_bias=c.qkv_bias,
                              o_bias=c.o_bias, qk_norm=c.qk_norm, eps=c.norm_eps, window=c.layer_window(index),
                              sinks=c.attention_sinks)
        self.mlp_norm = decoder_norm(c, fk)
        moe = c.is_moe_layer(index)  # MoE layers hold `moe.*` and no `mlp.*`, as the catalog names them
        act = c.hidden_act or "silu"
        self.mlp = None if moe else SwiGLU(c.hidden, c.ffn, fk, bias=c.mlp_bias, act=act, gated=c.gated_mlp)
        glu = clamped_swiglu(c.swiglu_limit, c.swiglu_alpha) if c.swiglu_limit else None
        self.moe = (MoE(c.hidden, c.moe_ffn, c.experts, c.top_k, fk, norm_topk_prob=c.norm_topk_prob,
                        act=activation(act), bias=c.moe_bias, glu=glu) if moe else None)

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        h = self.mlp_norm(x)
        if self.moe is not None:
            return x + self.moe(h)
        assert self.mlp is not None
        return x + self.mlp(h)


class GptBlock(nn.Module):
    """Pre-LN GPT/ViT layer with biases everywhere and plain multi-head attention; causal for GPT, not for ViT."""

    def __init__(self, hidden: int, heads: int, head_dim: int, ffn: int, fk: Factory, *, causal: bool,
                 eps: float = NORM_EPS, act: str = "gelu_new") -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=eps, **fk)
        self.attn = Attention(hidden, heads, heads, head_dim, fk, qkv_bias=True, o_bias=True, causal=causal)
        self.ln2 = nn.LayerNorm(hidden, eps=eps, **fk)
        self.mlp = GeluMLP(hidden, ffn, hidden, fk, act or "gelu_new")

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), rope)
        return x + self.mlp(self.ln2(x))
