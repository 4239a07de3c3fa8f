"""One pipeline stage of a decoder LLM, cut from the full model so parameter names stay the
catalog's ("llm.layers.5.attn.q.weight" stays that on whichever stage holds layer 5).

The first stage maps tokens to hidden states (embedding, learned positions), every stage
runs its layers, the last one applies the final norm and the output head. Which layers a
stage holds is the contract's rule (parallelism/layout/placement.layer_stages): with
L % pp = r, the first r stages hold one layer more.

Interleaved pipelines (vpp > 1): the layers are cut into pp*vpp chunks (virtual stages) and
chunk c runs on pipeline rank c % pp, the planner's rule. A rank's DecoderStage then holds
the layers of all its chunks (its state, named as the catalog names it); `chunk(c)` is the
module of one virtual stage, sharing those layers, that the interleaved schedule runs.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from parallelism.layout.placement import layer_stages
from parallelism.training.layers import rope_cos_sin
from parallelism.training.model import TrainingModel


class DecoderStage(nn.Module):
    """Holds `llm.{embed,pos_embed}` (first stage), `llm.layers.<i>` for its layers, and
    `llm.{final_norm,head}` (last stage). forward: tokens [B, T] (first stage) or hidden
    [B, T, H] -> hidden [B, T, H], or logits [B, T, vocab] on the last stage."""

    def __init__(self, model: TrainingModel, stage: int, stages: int, sequence_shards: int = 1,
                 virtual: int = 1) -> None:
        """sequence_shards: tp under sequence parallelism (hidden states between layers hold
        T/tp positions; the rotary tables still cover all T), else 1. virtual: vpp, the
        chunks each of the `stages` pipeline ranks holds."""
        if model.encoder is not None:
            raise ValueError(f"{model.config.name}: this stage is the decoder-only one; a multimodal model's LLM "
                             "stage is ImageTextStage (parallelism/training/image_text_stage.py)")
        self._cut(model, stage, stages, sequence_shards, virtual)

    def _cut(self, model: TrainingModel, stage: int, stages: int, sequence_shards: int, virtual: int = 1) -> None:
        super().__init__()
        self.sequence_shards = sequence_shards
        self.context = None  # a ContextShard under context parallelism (parallelize_context)
        llm = model.llm
        self.first, self.last = stage == 0, stage == stages - 1
        self.index, self.stages, self.virtual = stage, stages, virtual
        self.tied = llm.head is None
        self.config, self.rope_theta, self.gpt = llm.config, llm.rope_theta, llm.gpt
        self.layer_count = len(llm.layers)
        mine = [i for i, s in enumerate(layer_stages(len(llm.layers), stages, virtual)) if s == stage]
        self.llm = nn.Module()
        # Tied: the last stage holds its own copy of the embedding as its head (same name, same
        # values; the trainer sums both copies' gradients, parallelism/training/parallel.py).
        self.llm.embed = llm.embed if self.first or (self.last and self.tied) else None
        self.llm.pos_embed = llm.pos_embed if self.first else None
        # A ModuleDict keyed by the global index keeps every layer's catalog name.
        self.llm.layers = nn.ModuleDict({str(i): llm.layers[i] for i in mine})
        # GPT-style positions under sequence parallelism: as in Megatron-LM, the first stage
        # adds the learned positions to the full embedded sequence, then scatters it over
        # the TP ranks (the plan makes this module's output Shard(1); its backward all-gathers).
        self.llm.seq_scatter = nn.Identity() if self.first and self.gpt and sequence_shards > 1 else None
        self.llm.final_norm = llm.final_norm if self.last else None
        self.llm.head = llm.head if self.last else None

    def chunk(self, index: int) -> DecoderStage:
        """Virtual stage `index` (of stages * virtual, on pipeline rank index % stages): a
        stage of the flat pp*vpp cut made of this stage's own modules (the embedding on
        chunk 0, the final norm and head on the last chunk), so it trains this state."""
        chunks = self.stages * self.virtual
        if index % self.stages != self.index or not 0 <= index < chunks:
            raise ValueError(f"virtual stage {index} of {chunks} does not run on pipeline rank {self.index}")
        part = type(self).__new__(type(self))  # an ImageTextStage's chunks are ImageTextStages
        nn.Module.__init__(part)
        part.sequence_shards, part.tied, part.layer_count = self.sequence_shards, self.tied, self.layer_count
        part.context = self.context
        part.config, part.rope_theta, part.gpt = self.config, self.rope_theta, self.gpt
        part.first, part.last = index == 0, index == chunks - 1
        part.index, part.stages, part.virtual = index, chunks, 1
        llm = self.llm
        part.llm = nn.Module()
        part.llm.embed = llm.embed if part.first or (part.last and self.tied) else None
        part.llm.pos_embed = llm.pos_embed if part.first else None
        # layer_stages with vpp=1 over all chunks: the chunk of every layer.
        mine = [str(i) for i, c in enumerate(layer_stages(self.layer_count, chunks)) if c == index]
        part.llm.layers = nn.ModuleDict({i: llm.layers[i] for i in mine})
        part.llm.seq_scatter = llm.seq_scatter if part.first else None
        part.llm.final_norm = llm.final_norm if part.last else None
        part.llm.head = llm.head if part.last else None
        return part

    def forward(self, x: Tensor) -> Tensor:
        if self.virtual > 1:
            raise RuntimeError("an interleaved pipeline rank runs its virtual stages (chunk(c)), not all its layers")
        if self.first:
            x = self.llm.embed(x)
        x = self.run_layers(x)
        if not self.last:
            return x
        x = self.llm.final_norm(x)
        return tied_logits(x, self.llm.embed.weight) if self.tied else self.llm.head(x)

    def run_layers(self, x: Tensor) -> Tensor:
        """Hidden states [B, T(/tp), H] through this stage's layers (learned positions added
        on the first stage of a GPT-style model, rotary tables for all T otherwise). Under
        context parallelism T is the rank's chunk and the positions start at its offset."""
        if self.gpt and self.first:  # the embedding's output is the whole sequence (see seq_scatter)
            start = self.context.start(x.shape[1]) if self.context is not None else 0
            x = x + self.llm.pos_embed(torch.arange(start, start + x.shape[1], device=x.device))
            if self.llm.seq_scatter is not None:
                x = self.llm.seq_scatter(x)
        return self.run_blocks(x)

    def run_blocks(self, x: Tensor) -> Tensor:
        """Hidden states [B, T(/tp), H] through this stage's layers only (rotary tables for
        all T positions, from the context chunk's offset, in a llama-style model; learned
        positions are the caller's)."""
        rope = None
        if not self.gpt:
            length = x.shape[1] * self.sequence_shards
            start = self.context.start(length) if self.context is not None else 0
            rope = rope_cos_sin(length, self.config.rope_dim, self.rope_theta, x.device, start,
                                self.config.rope_scaling)
        for layer in self.llm.layers.values():
            x = layer(x, rope)
        return x


def tied_logits(x: Tensor, weight: Tensor) -> Tensor:
    """The output head of a tied model: hidden states times the embedding's transpose. Under
    tensor parallelism the weight is the vocab-parallel embedding's DTensor (rows split over
    tp, as the untied head's): the hidden states (replicated, or split over the sequence)
    are gathered, each rank computes its vocabulary slice and the logits are gathered, as
    the untied head's ColwiseParallel plan does."""
    if not isinstance(weight, DTensor):
        return torch.nn.functional.linear(x, weight)
    mesh = weight.device_mesh
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    logits = torch.nn.functional.linear(x.redistribute(mesh, [Replicate()]), weight)
    return logits.redistribute(mesh, [Replicate()]).to_local()
