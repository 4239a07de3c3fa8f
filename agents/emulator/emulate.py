"""`dynaplane emulate`: trace the real program for a configuration, simulate its step on a
device profile, report docs/contracts.md section 4's object."""
from __future__ import annotations

import time
from dataclasses import dataclass

from agents.emulator.devices import DeviceProfile, get_profile, load_profile
from agents.emulator.errors import EmulatorError
from agents.emulator.metrics import (hardware_tflops_per_gpu, mfu, model_flops_per_token, model_tflops_per_gpu,
                                     tokens_per_second)
from agents.emulator.simulate import RECOMPUTE, simulate
from agents.emulator.tracer import TraceRequest, trace
from agents.layout.catalog import get_config, get_model
from agents.layout.errors import LayoutError
from agents.layout.placement import place


@dataclass(frozen=True)
class EmulateRequest:
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
    sequence_parallel: bool = False  # Megatron-style, with tp > 1 (agents/training/parallel.py TrainConfig)


def matmul_params(model_name: str) -> float:
    """Parameters a token passes through in a matmul: all but the input embedding lookup
    (unless tied to the head), and for MoE layers only the experts a token is routed to."""
    spec, config = get_model(model_name), get_config(model_name).llm
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


def _profile(request: EmulateRequest) -> DeviceProfile:
    return load_profile(request.profile) if request.profile else get_profile(request.gpu)


def check_request(request: EmulateRequest) -> int:
    """Validate; returns the number of micro-batches. EmulatorError names what is wrong."""
    if request.recompute not in RECOMPUTE:
        raise EmulatorError(f"--recompute {request.recompute!r} not in {RECOMPUTE}")
    for key in ("gpus", "global_batch", "micro_batch", "seq", "gpus_per_node"):
        if getattr(request, key) < 1:
            raise EmulatorError(f"--{key.replace('_', '-')} {getattr(request, key)} must be >= 1")
    try:
        placement = place(get_model(request.model), request.layout)
    except (LayoutError, KeyError) as exc:
        raise EmulatorError(str(exc)) from exc
    ml = next(iter(placement.modules.values()))
    if placement.world != request.gpus:
        raise EmulatorError(f"layout {request.layout} needs {placement.world} GPUs "
                            f"(tp*pp*dp*cp = {ml.tp}*{ml.pp}*{ml.dp}*{ml.cp}); --gpus is {request.gpus}")
    per_replica = request.micro_batch * ml.dp
    if request.global_batch % per_replica:
        raise EmulatorError(f"global batch {request.global_batch} is not a multiple of micro-batch "
                            f"{request.micro_batch} x dp {ml.dp} = {per_replica}")
    return request.global_batch // per_replica


def emulate(request: EmulateRequest, *, use_cache: bool = True, progress=None) -> dict:
    started = time.perf_counter()
    try:
        multimodal = get_config(request.model).encoder is not None
    except LayoutError as exc:
        raise EmulatorError(str(exc)) from exc
    if multimodal:  # HeteroTrainer's program: per-module layouts (hetero_emulate.py)
        from agents.emulator.hetero_emulate import emulate_hetero

        return emulate_hetero(request, _profile(request), use_cache=use_cache, progress=progress)
    micro_batches = check_request(request)
    profile = _profile(request)
    traced, info = trace(TraceRequest(request.model, request.layout, request.micro_batch, request.seq,
                                      micro_batches, request.gpus_per_node, request.sequence_parallel), use_cache=use_cache, progress=progress)
    sim = simulate(traced, profile, request.gpus_per_node, request.recompute)
    config = get_config(request.model).llm
    tokens = tokens_per_second(request.global_batch, request.seq, sim.step_seconds)
    flops_per_token = model_flops_per_token(matmul_params(request.model), config.layers,
                                            config.heads * config.head_dim, request.seq)
    model_tflops = model_tflops_per_gpu(flops_per_token, tokens, request.gpus)
    classes = len({(s.memory, len(s.forward), len(s.backward)) for s in traced.stages})
    return {
        "model": request.model, "layout": request.layout, "gpus": request.gpus, "gpu": profile.name,
        "global_batch": request.global_batch, "micro_batch": request.micro_batch, "micro_batches": micro_batches,
        "seq": request.seq, "recompute": request.recompute, "sequence_parallel": request.sequence_parallel,
        "step_seconds": sim.step_seconds, "tokens_per_second": tokens,
        "model_tflops_per_gpu": model_tflops,
        "hardware_tflops_per_gpu": hardware_tflops_per_gpu(traced, sim.step_seconds, request.recompute),
        "mfu": mfu(model_tflops, profile),
        "memory": {"peak_bytes": sim.peak_bytes, "capacity_bytes": sim.hbm_bytes, "fits": sim.fits,
                   "per_stage": [{"stage": s.stage, "params": s.params, "grads": s.grads, "optimizer": s.optimizer,
                                  "activations": s.activations, "temporary": s.temporary, "peak": s.peak}
                                 for s in sim.per_stage]},
        "breakdown": dict(sim.breakdown),
        "ranks_emulated": request.gpus, "ranks_traced": classes, "trace_cached": info["cached"],
        "wall_seconds": time.perf_counter() - started,
    }
