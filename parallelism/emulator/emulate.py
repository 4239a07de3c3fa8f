"""`dynaplane emulate`: trace the real program for a configuration, simulate its step on a
device profile, report docs/contracts.md section 4's object.

Any model goes through the same check, trace and simulation; a model with an encoder (its
modules: encoder + LLM, HeteroTrainer's program) adds its per-module fields to the object:
`placement`, `image_tokens`, `llm_tokens_per_second`, `phases`, `encoder_chunks`,
`critical_module`, `per_module`, and a `module` on each memory row.

Throughput: `tokens_per_second` counts text tokens (global batch x seq, as the trainers'
steps report); `llm_tokens_per_second` counts every position the LLM runs (image tokens +
text). Model FLOPs (PaLM appendix B convention, metrics.py): a decoder-only model's 6N +
12 L d s per token; with an encoder both modules: the LLM's 6N + 12 L d s per position (the
head only on text positions, the only ones it runs on) and the encoder's 6N + 12 L d P per
image token (bidirectional attention; the position table and class token are lookups).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from parallelism.emulator.attention_kernels import ATTENTION_KERNELS, with_attention
from parallelism.emulator.devices import DeviceProfile, get_profile, load_profile
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.grad_accumulation import GRAD_ACCUMULATIONS, with_grad_accumulation
from parallelism.emulator.grad_sync import GRAD_SYNCS, with_grad_sync
from parallelism.emulator.hidden_dropout import with_hidden_dropout
from parallelism.emulator.optimizer_step import OPTIMIZERS, with_optimizer
from parallelism.emulator.param_gather import PARAM_GATHERS, with_param_gather
from parallelism.emulator.pipeline_p2p import PIPELINE_P2PS, with_pipeline_p2p
from parallelism.emulator.elementwise import ELEMENTWISE, LayerShape, with_elementwise
from parallelism.emulator.precision import FP8_CASTS, FP8_SCALINGS, PRECISIONS, Dims, with_precision
from parallelism.emulator.stack_memory import MEMORY_MODELS, with_stack_memory
from parallelism.emulator.stacks import STACKS, stack_defaults
from parallelism.emulator.metrics import (hardware_tflops_per_gpu, mfu, model_flops_per_token, model_tflops_per_gpu,
                                     module_flops, tokens_per_second)
from parallelism.emulator.simulate import RECOMPUTE, SimResult, simulate
from parallelism.emulator.trace import Trace
from parallelism.emulator.tracer import TraceRequest, trace
from parallelism.layout.catalog import model_from_config
from parallelism.layout.model_request import ModelConfig, NamesAModel, resolved_field
from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import Placement, place
from parallelism.training.parallel import TrainConfig, TrainingError


@dataclass(frozen=True)
class EmulateRequest(NamesAModel):
    model: str
    layout: str
    gpus: int
    gpu: str
    global_batch: int
    micro_batch: int
    seq: int
    recompute: str = "none"
    gpus_per_node: int = 8
    profile: str | None = None  # a calibrated profile file instead of the built-in `gpu`
    sequence_parallel: bool = False  # Megatron-style, with tp > 1 (parallelism/training/parallel.py TrainConfig)
    # The attention kernels the run uses (attention_kernels.py): the traced program's fused
    # "flash", or "unfused" core attention as Megatron-LM ran it before FlashAttention, with
    # dropout on its probabilities.
    attention: str = "flash"
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0  # dropout on the residual stream (hidden_dropout.py; Megatron's default 0.1)
    # When data-parallel gradients are reduced (grad_sync.py): as the traced program does,
    # after the last backward ("step"), or in buckets through the backward ("overlapped").
    grad_sync: str = "program"
    # Where micro-batch gradients are accumulated (grad_accumulation.py): in a pass of their own
    # as the program does, or "fused" into the weight-gradient GEMMs (Megatron-LM since 2022).
    grad_accumulation: str = "program"
    # How activations move between pipeline stages (pipeline_p2p.py): the program's asynchronous
    # sends, or Megatron-LM's synchronous scatter-gather exchange.
    pipeline_p2p: str = "program"
    # The optimizer step's kernels (optimizer_step.py): the program's (fused AdamW), or
    # "megatron": Megatron-LM's mixed-precision optimizer with apex's fused Adam.
    optimizer: str = "program"
    # The linear layers' GEMM precision (precision.py): bf16 as traced, or fp8 as Transformer
    # Engine and torchao run it, with its scaling recipe.
    precision: str = "bf16"
    fp8_scaling: str = "delayed"
    fp8_casts: str = "separate"  # precision.FP8_CASTS: kernels of their own, or fused as Transformer Engine's
    # A decoder layer's element-wise kernels (elementwise.py): the program's eager ones, or
    # Transformer Engine's fused ones.
    elementwise: str = "program"
    # What the run keeps in memory (stack_memory.py): the traced program's, or Megatron-Core's.
    memory_model: str = "program"
    # When ZeRO-1/2's parameter all-gathers run (param_gather.py): after the optimizer, or beside
    # the next step's first forward (Megatron-Core's overlap_param_gather).
    param_gather: str = "step"
    # The program the run used (stacks.py): its settings fill the options left at their defaults.
    stack: str = "program"
    model_config: ModelConfig | None = resolved_field()  # `model` resolved once (NamesAModel)
    model_error = EmulatorError


def matmul_params(model: ModelConfig) -> float:
    """Parameters a token passes through in a matmul: all but the input embedding lookup
    (unless tied to the head), and for MoE layers only the experts a token is routed to."""
    spec, config = model_from_config(model), model.llm
    total = 0.0
    for t in spec.tensors:
        n = float(t.numel)
        if t.name == "llm.embed.weight" and not config.tied:
            continue
        if t.split.module != "llm":
            continue  # an encoder's tokens are not the LLM's tokens
        if ".moe.experts." in t.name:
            n *= config.top_k / config.experts
        total += n
    return total


def model_flops_per_sample(mc: ModelConfig, seq: int) -> dict[str, float]:
    """Model FLOPs of one sample (one image + seq text tokens) of a model with an encoder,
    forward + backward, per module."""
    spec = model_from_config(mc)
    c, v = mc.llm, mc.encoder
    params = {"llm": 0.0, "head": 0.0, "encoder": 0.0}
    for t in spec.tensors:
        if t.name == "llm.embed.weight" or t.name in ("encoder.pos_embed.weight", "encoder.cls_token"):
            continue
        key = "head" if t.name == "llm.head.weight" else t.split.module
        params[key] += float(t.numel)
    positions = v.positions + seq
    llm = (6 * params["llm"] + 12 * c.layers * c.heads * c.head_dim * positions) * positions + 6 * params["head"] * seq
    encoder = (6 * params["encoder"] + 12 * v.layers * v.hidden * v.positions) * v.positions
    return {"llm": llm, "encoder": encoder}


def placement_kind(placement: Placement) -> str:
    if not placement.layout.is_heterogeneous:
        return "homogeneous"
    return "colocated" if placement.modules["encoder"].first_rank is None else "non-colocated"


def _profile(request: EmulateRequest) -> DeviceProfile:
    return load_profile(request.profile) if request.profile else get_profile(request.gpu)


def check_request(request: EmulateRequest) -> int:
    """Validate; returns the number of micro-batches. EmulatorError names what is wrong."""
    return _checked(request)[1]


# The request's fields with a fixed set of choices, and the choices.
RUN_CHOICES = (("recompute", RECOMPUTE), ("grad_accumulation", GRAD_ACCUMULATIONS), ("pipeline_p2p", PIPELINE_P2PS),
               ("grad_sync", GRAD_SYNCS), ("attention", ATTENTION_KERNELS), ("optimizer", OPTIMIZERS),
               ("precision", PRECISIONS), ("fp8_scaling", FP8_SCALINGS), ("fp8_casts", FP8_CASTS), ("elementwise", ELEMENTWISE),
               ("memory_model", MEMORY_MODELS), ("param_gather", PARAM_GATHERS),
               ("stack", tuple(STACKS)))


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _checked(request: EmulateRequest) -> tuple[Placement, int]:
    for key, choices in RUN_CHOICES:
        if getattr(request, key) not in choices:
            raise EmulatorError(f"{_flag(key)} {getattr(request, key)!r} not in {choices}")
    for key in ("attention_dropout", "hidden_dropout"):
        value = getattr(request, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise EmulatorError(f"{_flag(key)} {value!r} must be a number in [0, 1)")
    dropout = request.attention_dropout
    if dropout and request.attention == "flash":
        raise EmulatorError("--attention-dropout is modelled for --attention unfused only (a flash kernel drops "
                            "inside the fused kernel, with no pass of its own)")
    if request.precision == "fp8" and "fp8" not in _profile(request).peak_flops:
        profile = _profile(request)
        raise EmulatorError(f"--precision fp8: device {profile.name} has no FP8 rate (its profile's peak_flops has "
                            f"{', '.join(sorted(profile.peak_flops))}); FP8 GEMMs need Hopper or later (h100, h200, b200)")
    for key in ("gpus", "global_batch", "micro_batch", "seq", "gpus_per_node"):
        if getattr(request, key) < 1:
            raise EmulatorError(f"{_flag(key)} {getattr(request, key)} must be >= 1")
    try:
        placement = place(request.tensors, request.layout)
    except (LayoutError, KeyError) as exc:
        raise EmulatorError(str(exc)) from exc
    modules = len(placement.model.modules) > 1
    ml = placement.modules["llm"]
    if request.optimizer == "megatron" and ml.zero == 3:
        raise EmulatorError(f"--optimizer megatron with layout {request.layout}: Megatron-LM's optimizer steps "
                            "whole or ZeRO-1 shards of parameters, not FSDP's (zero=3)")
    if modules:
        _check_modules(request, placement)
    elif placement.world != request.gpus:
        raise EmulatorError(f"layout {request.layout} needs {placement.world} GPUs "
                            f"(tp*pp*dp*cp = {ml.tp}*{ml.pp}*{ml.dp}*{ml.cp}); --gpus is {request.gpus}")
    per_replica = request.micro_batch * ml.dp
    if request.global_batch % per_replica:
        raise EmulatorError(f"global batch {request.global_batch} is not a multiple of micro-batch "
                            f"{request.micro_batch} x {'llm ' if modules else ''}dp {ml.dp} = {per_replica}")
    micro_batches = request.global_batch // per_replica
    if modules:  # HeteroTrainer's rules (placement.hetero_refusal and the batch's)
        from parallelism.training.hetero import check_hetero_trainable

        try:
            check_hetero_trainable(TrainConfig(model=request.model, global_batch=request.global_batch,
                                               seq_len=request.seq, micro_batches=micro_batches,
                                               sequence_parallel=request.sequence_parallel), placement)
        except TrainingError as exc:
            raise EmulatorError(f"layout {request.layout}: {exc}") from exc
    return placement, micro_batches


def _check_modules(request: EmulateRequest, placement: Placement) -> None:
    """A per-module layout's ranks: every rank of --gpus belongs to a module."""
    enc, llm = placement.modules["encoder"], placement.modules["llm"]
    if placement.world != request.gpus:
        raise EmulatorError(f"layout {request.layout} spans ranks 0-{placement.world - 1} ({placement.world} GPUs); "
                            f"--gpus is {request.gpus}")
    if enc.first_rank is not None and enc.world + llm.world != placement.world:
        used = sorted([(enc.offset, enc.last_rank), (llm.offset, llm.last_rank)])
        raise EmulatorError(f"layout {request.layout}: ranks between {used[0][1]} and {used[1][0]} belong to no "
                            f"module (encoder ranks={enc.offset}-{enc.last_rank}, llm ranks={llm.offset}-{llm.last_rank})")


def emulate(request: EmulateRequest, *, use_cache: bool = True, progress=None) -> dict:
    started = time.perf_counter()
    if request.stack not in STACKS:
        raise EmulatorError(f"--stack {request.stack!r} not in {tuple(STACKS)}")
    request = stack_defaults(request)
    placement, micro_batches = _checked(request)
    profile = _profile(request)
    traced, info = trace(TraceRequest(request.model, request.layout, request.micro_batch, request.seq,
                                      micro_batches, request.gpus_per_node, request.sequence_parallel),
                         use_cache=use_cache, progress=progress)
    traced = as_run(traced, request)
    sim = simulate(traced, profile, request.gpus_per_node, request.recompute)
    step = sim.step_seconds
    tokens = tokens_per_second(request.global_batch, request.seq, step)
    if traced.inputs:
        per_sample = model_flops_per_sample(request.model_config, request.seq)
        model_tflops = request.global_batch * sum(per_sample.values()) / step / request.gpus / 1e12
        hardware = module_flops(traced, request.recompute)
        hardware_tflops = sum(hardware.values()) / step / request.gpus / 1e12
        ranks_traced = info["classes"]
    else:
        config = request.model_config.llm
        flops_per_token = model_flops_per_token(matmul_params(request.model_config), config.layers,
                                                config.heads * config.head_dim, request.seq)
        model_tflops = model_tflops_per_gpu(flops_per_token, tokens, request.gpus)
        hardware_tflops = hardware_tflops_per_gpu(traced, step, request.recompute)
        ranks_traced = len({(s.memory, len(s.forward), len(s.backward)) for s in traced.stages})
    inputs = traced.inputs
    rows = memory_rows(sim, traced)
    result = {
        "model": request.model, "layout": request.layout,
        **({"placement": placement_kind(placement)} if inputs else {}),
        "gpus": request.gpus, "gpu": profile.name,
        "global_batch": request.global_batch, "micro_batch": request.micro_batch, "micro_batches": micro_batches,
        "seq": request.seq, **{"image_tokens": i.tokens for i in inputs},
        "recompute": request.recompute, "sequence_parallel": request.sequence_parallel,
        **({"attention": request.attention, "attention_dropout": request.attention_dropout}
           if request.attention != "flash" else {}),
        **({"hidden_dropout": request.hidden_dropout} if request.hidden_dropout else {}),
        **({"grad_sync": request.grad_sync} if request.grad_sync != "program" else {}),
        **({"grad_accumulation": request.grad_accumulation} if request.grad_accumulation != "program" else {}),
        **({"pipeline_p2p": request.pipeline_p2p} if request.pipeline_p2p != "program" else {}),
        **({"optimizer": request.optimizer} if request.optimizer != "program" else {}),
        **({"precision": request.precision, "fp8_scaling": request.fp8_scaling, "fp8_casts": request.fp8_casts}
           if request.precision != "bf16" else {}),
        **({"elementwise": request.elementwise} if request.elementwise != "program" else {}),
        **({"memory_model": request.memory_model} if request.memory_model != "program" else {}),
        **({"param_gather": request.param_gather} if request.param_gather != "step" else {}),
        **({"stack": request.stack} if request.stack != "program" else {}),
        "step_seconds": step, "tokens_per_second": tokens,
        **({"llm_tokens_per_second": request.global_batch * (request.seq + sum(i.tokens for i in inputs)) / step}
           if inputs else {}),
        "model_tflops_per_gpu": model_tflops,
        "hardware_tflops_per_gpu": hardware_tflops,
        "mfu": mfu(model_tflops, profile),
        "memory": {"peak_bytes": sim.peak_bytes, "capacity_bytes": sim.hbm_bytes, "fits": sim.fits,
                   "per_stage": rows},
        "breakdown": dict(sim.breakdown),
    }
    for item in inputs:  # an encoder's modules: the step's split between them
        result.update({
            "phases": dict(sim.phases), "encoder_chunks": sim.chunks, "critical_module": sim.critical_module,
            "per_module": {
                item.module: {"ranks": item.world, "samples_per_rank": item.samples,
                              "model_tflop_per_step": request.global_batch * per_sample[item.module] / 1e12,
                              "hardware_tflop_per_step": hardware[item.module] / 1e12,
                              "memory": sim.input_memory[item.module]},
                "llm": {"ranks": traced.world, "model_tflop_per_step": request.global_batch * per_sample["llm"] / 1e12,
                        "hardware_tflop_per_step": hardware["llm"] / 1e12,
                        "memory": [{k: v for k, v in r.items() if k != "module"} for r in rows if r["module"] == "llm"]},
            }})
        if not item.colocated and sim.chunks > 1:  # what HeteroTrainer runs today: the whole batch at once
            result["phases"]["trainer_schedule_step_seconds"] = simulate(
                traced, profile, request.gpus_per_node, request.recompute, chunks=1).step_seconds
    result.update({"ranks_emulated": request.gpus, "ranks_traced": ranks_traced, "trace_cached": info["cached"],
                   "trace_seconds": info["trace_seconds"],
                   "wall_seconds": time.perf_counter() - started})
    return result


def as_run(traced: Trace, request: EmulateRequest) -> Trace:
    """The traced program as the request's run differs from it: its GEMM precision, dropout, attention kernels, where it
    accumulates and when it reduces its gradients, how its pipeline exchanges, how it steps (each a
    no-op at the program's own default)."""
    traced = with_precision(traced, request.precision, Dims.of(request.model_config.llm), request.fp8_scaling,
                            request.gpus_per_node, request.fp8_casts)
    layer = LayerShape.of(request.model_config.llm)
    traced = with_elementwise(traced, request.elementwise, layer, request.sequence_parallel)
    traced = with_stack_memory(traced, request.memory_model, layer, request.sequence_parallel,
                               fp8=request.precision == "fp8")
    traced = with_hidden_dropout(traced, request.hidden_dropout, request.sequence_parallel)
    traced = with_attention(traced, request.attention, request.attention_dropout)
    traced = with_grad_accumulation(traced, request.grad_accumulation)
    traced = with_pipeline_p2p(traced, request.pipeline_p2p, request.sequence_parallel)
    traced = with_optimizer(traced, request.optimizer, fp32_grads=request.grad_accumulation == "fused")
    traced = with_param_gather(traced, request.param_gather)
    return with_grad_sync(traced, request.grad_sync)


def memory_rows(sim: SimResult, traced: Trace) -> list[dict]:
    """One row per pipeline stage (the LLM's, with the bytes a colocated encoder adds), one
    per input module on ranks of its own; with input modules each row names its module."""
    rows = []
    for s in sim.per_stage:
        row = {"stage": s.stage, "params": s.params, "grads": s.grads, "optimizer": s.optimizer,
               "activations": s.activations, "temporary": s.temporary, "overlap": s.overlap, "peak": s.peak}
        if traced.inputs:
            row = {"module": "llm", **row, **{i.module: s.inputs for i in traced.inputs if i.colocated}}
        rows.append(row)
    return rows + [{"module": i.module, "stage": 0, **sim.input_memory[i.module]} for i in traced.inputs
                   if not i.colocated]
