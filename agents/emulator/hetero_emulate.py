"""`dynaplane emulate` for a model with an encoder: trace HeteroTrainer's program for the
layout (plain = the same layout for both modules, `encoder:...;llm:...` colocated, or with
`ranks=` non-colocated), simulate the step (hetero_sim.py) and report emulate()'s object
plus the per-module split.

Throughput: `tokens_per_second` counts text tokens (global batch x seq, as the trainer's
step reports); `llm_tokens_per_second` counts every position the LLM runs (image tokens +
text). Model FLOPs (PaLM appendix B convention, metrics.py) count both modules: the LLM's
6N + 12 L d s per position (the head only on text positions, which are the only ones it
runs on) and the encoder's 6N + 12 L d P per image token (bidirectional attention; the
position table and class token are lookups, not matmuls).
"""
from __future__ import annotations

import time

from agents.emulator.devices import DeviceProfile
from agents.emulator.errors import EmulatorError
from agents.emulator.hetero_sim import simulate_hetero
from agents.emulator.hetero_trace import HeteroTrace
from agents.emulator.hetero_tracer import HeteroTraceRequest, trace_hetero
from agents.emulator.metrics import mfu, stage_flops
from agents.emulator.trace import ComputeOp
from agents.layout.catalog import get_config, get_model
from agents.layout.errors import LayoutError
from agents.layout.placement import Placement, place
from agents.training.parallel import TrainConfig, TrainingError


def placement_kind(placement: Placement) -> str:
    if not placement.layout.is_heterogeneous:
        return "homogeneous"
    return "colocated" if placement.modules["encoder"].first_rank is None else "non-colocated"


def check_hetero_request(request) -> tuple[Placement, int]:
    """Validate an EmulateRequest for a multimodal model; returns (placement, micro-batches).
    EmulatorError names what is wrong."""
    from agents.training.hetero import check_hetero_trainable

    try:
        placement = place(get_model(request.model), request.layout)
    except (LayoutError, KeyError) as exc:
        raise EmulatorError(str(exc)) from exc
    enc, llm = placement.modules["encoder"], placement.modules["llm"]
    if placement.world != request.gpus:
        raise EmulatorError(f"layout {request.layout} spans ranks 0-{placement.world - 1} ({placement.world} GPUs); "
                            f"--gpus is {request.gpus}")
    if enc.first_rank is not None and enc.world + llm.world != placement.world:
        used = sorted([(enc.offset, enc.last_rank), (llm.offset, llm.last_rank)])
        raise EmulatorError(f"layout {request.layout}: ranks between {used[0][1]} and {used[1][0]} belong to no "
                            f"module (encoder ranks={enc.offset}-{enc.last_rank}, llm ranks={llm.offset}-{llm.last_rank})")
    if request.sequence_parallel:
        raise EmulatorError("sequence parallelism is not supported by the heterogeneous trainer yet")
    per_replica = request.micro_batch * llm.dp
    if request.global_batch % per_replica:
        raise EmulatorError(f"global batch {request.global_batch} is not a multiple of micro-batch "
                            f"{request.micro_batch} x llm dp {llm.dp} = {per_replica}")
    micro_batches = request.global_batch // per_replica
    try:
        check_hetero_trainable(TrainConfig(model=request.model, global_batch=request.global_batch,
                                           seq_len=request.seq, micro_batches=micro_batches), placement)
    except TrainingError as exc:
        raise EmulatorError(f"layout {request.layout}: {exc}") from exc
    return placement, micro_batches


def model_flops_per_sample(model: str, seq: int) -> dict[str, float]:
    """Model FLOPs of one sample (one image + seq text tokens), forward + backward, per module."""
    mc, spec = get_config(model), get_model(model)
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


def _ops_flops(ops) -> float:
    return sum(op.flops for op in ops if isinstance(op, ComputeOp))


def hardware_flops(trace: HeteroTrace, recompute: str) -> dict[str, float]:
    """FLOPs the traced ops run in a step, all ranks of each module together."""
    llm = sum(stage_flops(trace.llm, recompute)) * trace.llm.tp * trace.llm.dp
    e = trace.encoder
    encoder = (_ops_flops(e.forward) * (2 if recompute == "full" else 1) + _ops_flops(e.backward)
               + _ops_flops(e.optimizer)) * trace.encoder_world
    return {"llm": llm, "encoder": encoder}


def emulate_hetero(request, profile: DeviceProfile, *, use_cache: bool = True, progress=None) -> dict:
    started = time.perf_counter()
    placement, micro_batches = check_hetero_request(request)
    traced, info = trace_hetero(HeteroTraceRequest(request.model, request.layout, request.global_batch,
                                                   request.micro_batch, request.seq, micro_batches,
                                                   request.gpus_per_node), use_cache=use_cache, progress=progress)
    sim = simulate_hetero(traced, profile, request.gpus_per_node, request.recompute)
    step = sim.step_seconds
    per_sample = model_flops_per_sample(request.model, request.seq)
    model_tflops = request.global_batch * sum(per_sample.values()) / step / request.gpus / 1e12
    hardware = hardware_flops(traced, request.recompute)
    image = traced.image_tokens
    enc_row = {"module": "encoder", "stage": 0, **sim.encoder_memory}
    rows = [{"module": "llm", **r} for r in sim.llm_memory] + ([] if traced.colocated else [enc_row])
    result = {
        "model": request.model, "layout": request.layout, "placement": placement_kind(placement),
        "gpus": request.gpus, "gpu": profile.name, "global_batch": request.global_batch,
        "micro_batch": request.micro_batch, "micro_batches": micro_batches, "seq": request.seq,
        "image_tokens": image, "recompute": request.recompute, "sequence_parallel": False,
        "step_seconds": step, "tokens_per_second": request.global_batch * request.seq / step,
        "llm_tokens_per_second": request.global_batch * (request.seq + image) / step,
        "model_tflops_per_gpu": model_tflops,
        "hardware_tflops_per_gpu": sum(hardware.values()) / step / request.gpus / 1e12,
        "mfu": mfu(model_tflops, profile),
        "memory": {"peak_bytes": sim.peak_bytes, "capacity_bytes": sim.hbm_bytes, "fits": sim.fits,
                   "per_stage": rows},
        "breakdown": dict(sim.breakdown),
        "phases": dict(sim.phases), "encoder_chunks": sim.chunks, "critical_module": sim.critical_module,
        "per_module": {
            "encoder": {"ranks": traced.encoder_world, "samples_per_rank": traced.encoder_samples,
                        "model_tflop_per_step": request.global_batch * per_sample["encoder"] / 1e12,
                        "hardware_tflop_per_step": hardware["encoder"] / 1e12, "memory": sim.encoder_memory},
            "llm": {"ranks": traced.llm.world, "model_tflop_per_step": request.global_batch * per_sample["llm"] / 1e12,
                    "hardware_tflop_per_step": hardware["llm"] / 1e12, "memory": list(sim.llm_memory)},
        },
        "ranks_emulated": request.gpus, "ranks_traced": info["classes"],
        "trace_cached": info["cached"], "wall_seconds": time.perf_counter() - started,
    }
    if not traced.colocated and sim.chunks > 1:  # what HeteroTrainer runs today: the whole batch at once
        result["phases"]["trainer_schedule_step_seconds"] = simulate_hetero(
            traced, profile, request.gpus_per_node, request.recompute, chunks=1).step_seconds
    return result
