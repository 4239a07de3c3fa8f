"""One pipeline stage of a multimodal model's LLM: the first stage puts the image tokens
(received through the boundary, already in the LLM's layout) before the text embeddings.

Parameter names stay the catalog's ("llm.layers.1.attn.q.weight"), and the attributes are
those of DecoderStage (`first`, `last`, `llm.*`), so parallel.tp_plan applies as it is.
The last stage predicts only the text positions: it drops the `image_tokens` leading
positions before the final norm, as model.Decoder does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelism.training.model import TrainingModel
from parallelism.training.stage import DecoderStage


class ImageTextStage(DecoderStage):
    """forward: first stage (tokens [b, T], image tokens [b, P, H]); later stages hidden
    [b, P+T, H]. Returns hidden [b, P+T, H], or text logits [b, T, vocab] on the last stage."""

    def __init__(self, model: TrainingModel, stage: int, stages: int) -> None:
        if model.encoder is None:
            raise ValueError(f"{model.config.name} has no image encoder: use DecoderStage")
        if model.llm.head is None:
            raise ValueError(f"{model.config.name}: tied embeddings are not supported by the heterogeneous trainer")
        self._cut(model, stage, stages, sequence_shards=1)
        self.image_tokens = model.encoder.num_tokens

    def forward(self, x: Tensor, image_tokens: Tensor | None = None) -> Tensor:
        llm = self.llm
        if self.first:
            if image_tokens is None:
                raise ValueError("the first stage needs the image tokens")
            text = llm.embed(x)
            x = torch.cat((image_tokens.to(text.dtype), text), dim=1)
        x = self.run_layers(x)
        if not self.last:
            return x
        return llm.head(llm.final_norm(x[:, self.image_tokens:]))


def text_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
