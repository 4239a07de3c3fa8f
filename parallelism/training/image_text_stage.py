"""One pipeline stage of a multimodal model's LLM: the first stage puts the image tokens
(received through the boundary, already in the LLM's layout) before the text embeddings.

Parameter names stay the catalog's ("llm.layers.1.attn.q.weight"), and the attributes are
those of DecoderStage (`first`, `last`, `llm.*`), so parallel.tp_plan applies as it is
(image_text_tp_plan adds what sequence parallelism needs here).
The last stage predicts only the text positions: it drops the `image_tokens` leading
positions before the final norm, as model.Decoder does. A tied model's last stage uses
its copy of the embedding as the head (DecoderStage's rule); with pp > 1 the trainer sums
the two end stages' gradients of it (parallelism/training/ties.py).

Sequence parallelism (tp > 1): the combined sequence of P image + T text positions is what
is split over tp. The first stage gathers the text embedding (the vocab-parallel
embedding's all-reduce), puts the image tokens before it, adds learned positions (GPT
style) and splits [b, P+T, H] into the rank's [b, (P+T)/tp, H] slice (`seq_scatter`, whose
backward all-gathers: every TP rank returns the whole image-token gradient, as without SP).
Hidden states between layers and pipeline stages are that slice. The last stage gathers the
whole sequence back (`seq_gather`, whose backward keeps the rank's slice) before dropping
the image positions, so the final norm and the head run as without SP.

Context parallelism (cp > 1, `parallelize_context`): the first stage builds the whole
P + T sequence and keeps the rank's contiguous chunk of it ((P+T)/cp positions, then split
over tp under SP); the last stage drops the chunk's image positions (the first chunks may
hold image tokens only, no text: `text_span`), and the rank's loss is its text tokens'
share of the mean, times cp (`context_text_loss`).

Interleaved pipelines (vpp > 1): `chunk(c)` is DecoderStage's virtual stage, an
ImageTextStage: chunk 0 takes the image tokens, the last chunk drops their positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput

from parallelism.training.context_parallel import ContextShard
from parallelism.training.model import TrainingModel
from parallelism.training.parallel import tp_plan
from parallelism.training.stage import DecoderStage, tied_logits


class ImageTextStage(DecoderStage):
    """forward: first stage (tokens [b, T], image tokens [b, P, H]); later stages hidden
    [b, P+T, H] ([b, (P+T)/tp, H] under sequence parallelism). Returns hidden states of the
    same form, or text logits [b, T, vocab] on the last stage."""

    def __init__(self, model: TrainingModel, stage: int, stages: int, sequence_shards: int = 1,
                 virtual: int = 1) -> None:
        """sequence_shards: the LLM's tp under sequence parallelism, else 1. virtual: vpp, the
        chunks each pipeline rank holds (DecoderStage.chunk; the first chunk takes the image
        tokens, the last one drops their positions)."""
        if model.encoder is None:
            raise ValueError(f"{model.config.name} has no image encoder: use DecoderStage")
        self._cut(model, stage, stages, sequence_shards=sequence_shards, virtual=virtual)
        self.image_tokens = model.encoder.num_tokens
        split = sequence_shards > 1
        # Identity modules whose TP plan (image_text_tp_plan) splits / gathers the sequence.
        self.llm.seq_scatter = nn.Identity() if self.first and split else None
        self.llm.seq_gather = nn.Identity() if self.last and split else None

    def chunk(self, index: int) -> ImageTextStage:
        """Virtual stage `index` (DecoderStage.chunk), an ImageTextStage: chunk 0 takes the
        image tokens before the text, the last chunk gathers the sequence (under SP) and
        drops the image positions."""
        part = super().chunk(index)
        assert isinstance(part, ImageTextStage)
        part.image_tokens = self.image_tokens
        part.llm.seq_gather = self.llm.seq_gather if part.last else None
        return part

    def forward(self, x: Tensor, image_tokens: Tensor | None = None) -> Tensor:
        if self.virtual > 1:
            raise RuntimeError("an interleaved pipeline rank runs its virtual stages (chunk(c)), not all its layers")
        llm = self.llm
        if self.first:
            if image_tokens is None:
                raise ValueError("the first stage needs the image tokens")
            text = llm.embed(x)
            x = torch.cat((image_tokens.to(text.dtype), text), dim=1)
            if self.gpt:
                x = x + llm.pos_embed(torch.arange(x.shape[1], device=x.device))
            if self.context is not None:  # this rank's chunk of the combined sequence
                local = x.shape[1] // self.context.size
                x = x[:, self.context.start(local):self.context.start(local) + local]
            if llm.seq_scatter is not None:
                x = llm.seq_scatter(x)
        x = self.run_blocks(x)
        if not self.last:
            return x
        if llm.seq_gather is not None:
            x = llm.seq_gather(x)
        if self.context is None:
            return self._logits(llm.final_norm(x[:, self.image_tokens:]))
        # A cp chunk drops its image positions (all of them in a chunk of image tokens only)
        # from the logits: DTensor's tensor-parallel head cannot take an empty sequence.
        drop = min(max(self.image_tokens - self.context.start(x.shape[1]), 0), x.shape[1])
        return self._logits(llm.final_norm(x))[:, drop:]

    def _logits(self, x: Tensor) -> Tensor:
        """The head, or a tied model's copy of the embedding as the head (DecoderStage's rule)."""
        return tied_logits(x, self.llm.embed.weight) if self.tied else self.llm.head(x)


def image_text_tp_plan(stage: ImageTextStage, kv_units: int | None = None) -> dict:
    """parallel.tp_plan of the stage, with sequence parallelism when it holds the split and
    gather modules: the layers' plan is the decoder's; the first stage's embedding output is
    replicated (all-reduce) and the combined sequence split by `seq_scatter`; the last stage
    gathers it (`seq_gather`), so its final norm and head take replicated input."""
    sequence_parallel = stage.sequence_shards > 1
    plan = tp_plan(stage, sequence_parallel, kv_units)
    if not sequence_parallel:
        return plan
    if stage.last:
        del plan["llm.final_norm"]  # tp_plan's SequenceParallel: here the norm runs after the gather
        plan["llm.seq_gather"] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        if stage.llm.head is not None:  # a tied head is the embedding's weight (stage.tied_logits gathers)
            plan["llm.head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    return plan


def text_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def text_span(image: int, text: int, shard: ContextShard) -> tuple[int, int]:
    """The text positions [lo, hi) (of `text`) in this rank's chunk of the combined sequence
    of `image` + `text` positions cut over cp: the first chunks may hold image tokens only."""
    local = (image + text) // shard.size
    start = shard.start(local)
    return max(start - image, 0), max(start + local - image, 0)


def context_text_loss(logits: Tensor, targets: Tensor, text: int, cp: int) -> Tensor:
    """A cp rank's share of the mean text loss, times cp: its chunk's token losses summed
    over the sequence's `text` tokens (chunks hold unequal, possibly no, text positions), so
    that averaging the cp ranks' gradients, as the dp x cp optimizer does, gives the mean's."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") * (cp / (text * len(targets)))
