"""The program a published run used, as a setting (`--stack`): each stack is a set of defaults
for the emulator's per-feature run options (emulate.EmulateRequest), so a run is described
by the program it ran and, where it differed from that program's defaults, by the options.

- "program": this project's own trainer, as traced.
- "megatron-core": Megatron-Core with Transformer Engine as NeMo 2.0 and Megatron-Bridge run
  it (2024-): flash (TE fused) attention, no dropout, the distributed optimizer with its
  gradient reduce-scatter overlapped with the backward and Megatron's optimizer kernels,
  gradient accumulation fused into the weight-gradient GEMMs, TE's fused element-wise
  kernels (elementwise.py), what it keeps in memory (stack_memory.py), TE's FP8 casts fused
  into its norms and activations with weights cast once a step (precision.py), its parameter
  all-gathers beside the next step's first forward (param_gather.py), asynchronous pipeline
  sends.
- "megatron-lm-2021": Megatron-LM as Narayanan et al. 2021 and Korthikanti et al. 2022 ran
  it: core attention unfused with dropout 0.1, hidden dropout 0.1, the synchronous pipeline
  exchange with scatter-gather, Megatron's optimizer kernels.
"""
from __future__ import annotations

import dataclasses

STACKS: dict[str, dict[str, object]] = {
    "program": {},
    "megatron-core": {"grad_sync": "overlapped", "grad_accumulation": "fused", "optimizer": "megatron",
                      "elementwise": "fused", "memory_model": "megatron-core", "fp8_casts": "fused",
                      "param_gather": "overlapped"},
    "megatron-lm-2021": {"attention": "unfused", "attention_dropout": 0.1, "hidden_dropout": 0.1,
                         "pipeline_p2p": "megatron", "optimizer": "megatron"},
}


def stack_defaults(request):
    """The request with its stack's settings in every option left at the program's default; an
    option the request sets otherwise keeps its value."""
    defaults = {f.name: f.default for f in dataclasses.fields(request)}
    changes = {key: value for key, value in STACKS[request.stack].items() if getattr(request, key) == defaults[key]}
    return dataclasses.replace(request, **changes) if changes else request
