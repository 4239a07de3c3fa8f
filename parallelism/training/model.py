"""The training model of a catalog config: optional ViT encoder + decoder LLM, named as the catalog names tensors."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallelism.layout.model_config import ACTIVATIONS, ROPE_THETA, DecoderConfig, ModelConfig, VisionConfig
from parallelism.training.layers import NORM_EPS, Factory, GeluMLP, GptBlock, LlamaBlock, decoder_norm, rope_cos_sin

__all__ = ["ROPE_THETA", "Decoder", "TrainingModel", "VisionEncoder", "build_training_model"]


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class Decoder(nn.Module):
    """The LLM: embed (+ learned positions for GPT), layers, final norm, head (absent when tied).
    RoPE base, norm epsilon, activation and MoE gating are the config's (`rope_theta` overrides its base)."""

    def __init__(self, c: DecoderConfig, fk: Factory, rope_theta: float | None = None) -> None:
        super().__init__()
        self.config, self.rope_theta = c, c.rope_theta if rope_theta is None else rope_theta
        self.gpt = c.style == "gpt"
        self.embed = nn.Embedding(c.vocab, c.hidden, **fk)
        self.pos_embed = nn.Embedding(c.positions, c.hidden, **fk) if self.gpt else None
        blocks: list[nn.Module] = [
            GptBlock(c.hidden, c.heads, c.head_dim, c.ffn, fk, causal=True, eps=c.norm_eps, act=c.hidden_act)
            if self.gpt else LlamaBlock(c, i, fk)
            for i in range(c.layers)
        ]
        self.layers = nn.ModuleList(blocks)
        self.final_norm: nn.Module = (nn.LayerNorm(c.hidden, eps=c.norm_eps, **fk) if self.gpt
                                      else decoder_norm(c, fk))
        self.head = None if c.tied else nn.Linear(c.hidden, c.vocab, bias=False, **fk)

    def forward(self, tokens: Tensor, prefix: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab] for the T text positions; `prefix` [B, P, hidden] (image tokens) goes first."""
        x = self.embed(tokens)
        skip = 0
        if prefix is not None:
            skip = prefix.shape[1]
            x = torch.cat((prefix.to(x.dtype), x), dim=1)
        length = x.shape[1]
        rope = None
        if self.pos_embed is not None:
            require(length <= self.config.positions,
                     f"sequence of {length} positions exceeds the {self.config.positions}-row position table")
            x = x + self.pos_embed(torch.arange(length, device=x.device))
        else:
            rope = rope_cos_sin(length, self.config.rope_dim, self.rope_theta, x.device,
                                scaling=self.config.rope_scaling)
        for layer in self.layers:
            x = layer(x, rope)
        # Only text positions predict tokens: skipping the image positions saves the vocab-sized matmul there.
        x = self.final_norm(x[:, skip:])
        return F.linear(x, self.embed.weight if self.head is None else self.head.weight)


class VisionEncoder(nn.Module):
    """ViT tower (class token, learned positions, pre-LN, bidirectional) and a 2-layer MLP projector into the LLM."""

    def __init__(self, v: VisionConfig, fk: Factory) -> None:
        super().__init__()
        self.config = v
        d = v.hidden
        # A module's own parameters list before its children, so this one comes first in named_parameters().
        self.cls_token = nn.Parameter(torch.zeros(1, d, **fk))
        self.patch_embed = nn.Linear(v.channels * v.patch * v.patch, d, bias=False, **fk)
        self.pos_embed = nn.Embedding(v.positions, d, **fk)
        self.pre_norm = nn.LayerNorm(d, eps=NORM_EPS, **fk)
        self.layers = nn.ModuleList(GptBlock(d, v.heads, d // v.heads, v.mlp, fk, causal=False)
                                    for _ in range(v.layers))
        self.final_norm = nn.LayerNorm(d, eps=NORM_EPS, **fk)
        self.projector = GeluMLP(d, v.proj_out, v.proj_out, fk)

    @property
    def num_tokens(self) -> int:
        """Tokens one image adds to the LLM's sequence: every patch plus the class token."""
        return self.config.positions

    def patchify(self, images: Tensor) -> Tensor:
        """[B, C, S, S] -> [B, (S/p)^2, C*p*p], rows in raster order, each flattened as (C, p, p) like a
        Conv2d kernel, so patch_embed.weight.view(D, C, p, p) is the equivalent convolution's weight.
        Worked example: S=16, p=4 gives 16 patches; patch 5 is row 1, column 1: pixels [4:8, 4:8]."""
        v = self.config
        b, c, s, s2 = images.shape
        require((c, s, s2) == (v.channels, v.image, v.image),
                 f"images of shape {tuple(images.shape)[1:]} do not match ({v.channels}, {v.image}, {v.image})")
        g, p = s // v.patch, v.patch
        x = images.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, g * g, c * p * p)

    def forward(self, images: Tensor) -> Tensor:
        """Image tokens [B, num_tokens, llm hidden] (class token first), ready to prepend to the text."""
        x = self.patch_embed(self.patchify(images.to(self.patch_embed.weight.dtype)))
        cls = self.cls_token.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos_embed.weight
        x = self.pre_norm(x)
        for layer in self.layers:
            x = layer(x)
        return self.projector(self.final_norm(x))


class TrainingModel(nn.Module):
    """encoder (multimodal configs only, registered first, as in the catalog's global order) then llm."""

    def __init__(self, config: ModelConfig, fk: Factory, rope_theta: float | None = None) -> None:
        super().__init__()
        self.config = config
        self.encoder = VisionEncoder(config.encoder, fk) if config.encoder is not None else None
        self.llm = Decoder(config.llm, fk, rope_theta)

    def forward(self, tokens: Tensor, images: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab] over the text tokens [B, T]; images [B, C, S, S] become a prefix when given."""
        prefix = None
        if images is not None:
            require(self.encoder is not None, f"{self.config.name} has no image encoder, yet images were given")
            assert self.encoder is not None
            prefix = self.encoder(images)
        return self.llm(tokens, prefix)

    def loss(self, tokens: Tensor, targets: Tensor, images: Tensor | None = None) -> Tensor:
        """Mean next-token cross entropy over the text positions (image positions have no targets)."""
        logits = self(tokens, images)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _validate(config: ModelConfig) -> None:
    c, v = config.llm, config.encoder
    require(c.style in ("llama", "gpt"), f"{config.name}: unknown decoder style {c.style!r}")
    require(c.heads % c.kv_heads == 0, f"{config.name}: heads {c.heads} not a multiple of kv_heads {c.kv_heads}")
    if c.style == "llama":
        require(c.head_dim % 2 == 0, f"{config.name}: RoPE needs an even head_dim, got {c.head_dim}")
    else:
        require(c.positions > 0, f"{config.name}: a gpt-style decoder needs positions > 0")
    require(c.hidden_act in ("", *ACTIVATIONS), f"{config.name}: unknown activation {c.hidden_act!r}")
    if v is not None:
        require(v.hidden % v.heads == 0, f"{config.name}: encoder hidden {v.hidden} not a multiple of {v.heads} heads")
        require(v.image % v.patch == 0, f"{config.name}: image {v.image} not a multiple of patch {v.patch}")
        require(v.proj_out == c.hidden, f"{config.name}: projector width {v.proj_out} != llm hidden {c.hidden}")


def build_training_model(config: ModelConfig, *, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32, rope_theta: float | None = None) -> TrainingModel:
    """The model of `config`, parameters created directly on `device` in `dtype`.

    On device="meta" nothing is allocated (shapes only): use `model.to_empty(device=...)` then
    `init_weights(model, seed)` to materialize. On a real device the values are PyTorch's defaults until
    `init_weights` runs.
    """
    _validate(config)
    fk: dict[str, Any] = {"device": torch.device(device), "dtype": dtype}
    return TrainingModel(config, fk, rope_theta)
