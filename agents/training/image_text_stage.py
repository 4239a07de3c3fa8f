"""One pipeline stage of a multimodal model's LLM: the first stage puts the image tokens
(received through the boundary, already in the LLM's layout) before the text embeddings.

Parameter names stay the catalog's ("llm.layers.1.attn.q.weight"), and the attributes are
those of DecoderStage (`first`, `last`, `llm.*`), so parallel._tp_plan applies as it is.
The last stage predicts only the text positions: it drops the `image_tokens` leading
positions before the final norm, as model.Decoder does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agents.layout.placement import layer_stages
from agents.training.layers import rope_cos_sin
from agents.training.model import TrainingModel


class ImageTextStage(nn.Module):
    """forward: first stage (tokens [b, T], image tokens [b, P, H]); later stages hidden
    [b, P+T, H]. Returns hidden [b, P+T, H], or text logits [b, T, vocab] on the last stage."""

    def __init__(self, model: TrainingModel, stage: int, stages: int) -> None:
        super().__init__()
        if model.encoder is None:
            raise ValueError(f"{model.config.name} has no image encoder: use DecoderStage")
        llm = model.llm
        if llm.head is None:
            raise ValueError(f"{model.config.name}: tied embeddings are not supported by the heterogeneous trainer")
        self.first, self.last = stage == 0, stage == stages - 1
        self.config, self.rope_theta, self.gpt = llm.config, llm.rope_theta, llm.gpt
        self.image_tokens = model.encoder.num_tokens
        mine = [i for i, s in enumerate(layer_stages(len(llm.layers), stages)) if s == stage]
        self.llm = nn.Module()
        self.llm.embed = llm.embed if self.first else None
        self.llm.pos_embed = llm.pos_embed if self.first else None
        self.llm.layers = nn.ModuleDict({str(i): llm.layers[i] for i in mine})
        self.llm.final_norm = llm.final_norm if self.last else None
        self.llm.head = llm.head if self.last else None

    def forward(self, x: Tensor, image_tokens: Tensor | None = None) -> Tensor:
        llm = self.llm
        if self.first:
            if image_tokens is None:
                raise ValueError("the first stage needs the image tokens")
            text = llm.embed(x)
            x = torch.cat((image_tokens.to(text.dtype), text), dim=1)
        length = x.shape[1]
        rope = None
        if self.gpt:
            if self.first:
                x = x + llm.pos_embed(torch.arange(length, device=x.device))
        else:
            rope = rope_cos_sin(length, self.config.head_dim, self.rope_theta, x.device)
        for layer in llm.layers.values():
            x = layer(x, rope)
        if not self.last:
            return x
        return llm.head(llm.final_norm(x[:, self.image_tokens:]))


def text_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
