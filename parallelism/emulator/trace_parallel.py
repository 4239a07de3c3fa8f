"""The decoder-only program traced: `ParallelTrainer` (parallelism/training/parallel.py: DTensor
TP, the ZeRO path or FSDP2), one module, pipelined. One of tracer.py's two programs.

Classes: the pipeline's stages (first, last, and middle stages by layer count). A class's
rank joins torch's fake process group, builds the real trainer from fake shards of exactly
its contract boxes and runs one micro-batch forward and backward and the optimizer step
under FakeTensorMode while an OpRecorder writes down every op, collective and live byte.
Static memory (params, grads, optimizer) is the size of the trainer's real tensors;
activations are what one micro-batch's forward leaves alive for its backward.

Interleaved layouts (vpp > 1): the trainer runs a rank's virtual stages with torch's
ScheduleInterleaved1F1B, each one an ordinary pipeline stage holding one model chunk
(DecoderStage.chunk, the same modules a flat stage of that chunk holds). A layout with vpp = v over pp ranks cuts
the layers into the same pp*v chunks as the plain layout with pp*v stages (placement.py:
the first L % (pp*v) chunks one layer longer), so the stage classes of that flat layout
are traced (same tp, dp, zero, micro-batch; a fake world of tp*pp*v*dp ranks) and returned
as the pp*v virtual stages of the interleaved Trace, with the p2p sends' node spans
recomputed for virtual stage k on pipeline rank k % pp.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.recorder import OpRecorder, ignoring_sharding_propagation
from parallelism.emulator.trace import CommOp, StageTrace, Trace, stage_from_dict, stage_to_dict
from parallelism.emulator.trace_accumulation import hold_accumulated_grads, tag_accumulation
from parallelism.emulator.trace_build import (TraceRequest, build_stage_trace, fake_shards, positions_between_stages,
                                         stage_classes, stage_memory, trainer_static_bytes)
from parallelism.layout.placement import layer_stages, place
from parallelism.training.parallel import LayoutMeshes, ParallelTrainer, TrainConfig, TrainingError, cross_entropy_loss

CLASS = "stage class"  # what tracer.py's progress lines call a class


def classes(request: TraceRequest) -> dict[tuple, list[int]]:
    """The (virtual) stages' classes, each with the stages it stands for."""
    spec = request.tensors
    ml = place(spec, request.layout).modules["llm"]
    return stage_classes(spec.modules[-1].num_layers, ml.pp * ml.vpp)


def class_key(request: TraceRequest, key: tuple) -> str:
    """A class's trace depends on the whole configuration."""
    return f"stage-{request.key()}-" + hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:12]


def label(key: tuple, member: int) -> str:
    return f"stage {member}"


def trace_class(request: TraceRequest, key: tuple, stage: int) -> dict:
    """{"stage": the StageTrace's dict} of one class, traced in this (fresh) process."""
    placement = place(request.tensors, request.layout)
    ml = placement.modules["llm"]
    # The request the stage processes trace: the flat layout when interleaved (see the module doc).
    flat = request if ml.vpp == 1 else dataclasses.replace(request, layout=flat_layout(placement))
    config = TrainConfig(model=request.model, global_batch=request.micro_batch * request.micro_batches * ml.dp,
                         seq_len=request.seq, micro_batches=request.micro_batches,
                         sequence_parallel=request.sequence_parallel)
    return {"stage": stage_to_dict(_trace_stage(config, flat, stage))}


def assemble(request: TraceRequest, parts: dict[tuple, dict]) -> Trace:
    ml = place(request.tensors, request.layout).modules["llm"]
    virtual = ml.pp * ml.vpp
    by_stage = {s: dataclasses.replace(stage_from_dict(parts[key]["stage"]), stage=s)
                for key, members in classes(request).items() for s in members}
    ordered = tuple(by_stage[s] for s in range(virtual))
    if ml.vpp > 1:
        ordered = tuple(interleaved_p2p(st, ml, request.gpus_per_node) for st in ordered)
    return Trace(model=request.model, tp=ml.tp, pp=ml.pp, dp=ml.dp, micro_batches=request.micro_batches,
                 micro_batch_size=request.micro_batch, seq=request.seq, zero=ml.zero, vpp=ml.vpp, ep=ml.ep, cp=ml.cp,
                 stages=ordered)


def flat_layout(placement) -> str:
    """The vpp=1 layout whose pp*vpp stages are the chunks of an interleaved layout."""
    ml = next(iter(placement.modules.values()))
    return dataclasses.replace(placement.layout.modules[0], pp=ml.pp * ml.vpp, vpp=1).to_string(False)


def interleaved_p2p(stage: StageTrace, ml, gpn: int, offset: int = 0) -> StageTrace:
    """Node spans of a virtual stage's p2p sends: virtual stage k runs on pipeline rank
    k % pp (first rank offset + (k % pp)*dp*cp*tp), its neighbours on (k +- 1) % pp."""
    k, stride = stage.stage, ml.dp * ml.cp * ml.tp
    rank = offset + (k % ml.pp) * stride

    def fix(op):
        if not (isinstance(op, CommOp) and op.dim == "pp" and op.kind == "send"):
            return op
        peer = offset + ((k + (1 if op.name == "pp_send_activations" else -1)) % ml.pp) * stride
        return dataclasses.replace(op, nodes=len({rank // gpn, peer // gpn}))

    return dataclasses.replace(stage, forward=tuple(fix(op) for op in stage.forward),
                               backward=tuple(fix(op) for op in stage.backward))


def _trace_stage(config: TrainConfig, request: TraceRequest, stage: int) -> StageTrace:
    spec = request.tensors
    placement = place(spec, request.layout)
    ml = next(iter(placement.modules.values()))
    # tp_rank 0, dp_rank 0 of the stage, and its last cp rank: the chunk at the end of the
    # sequence attends over every key, the most attention work of the cp group (the step waits for it).
    rank = stage * ml.dp * ml.cp * ml.tp + ml.tp * (ml.cp - 1)
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise EmulatorError("the tracer needs its own process: a real process group is already running here")
        dist.destroy_process_group()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=ml.world, store=FakeStore())
    try:
        meshes = LayoutMeshes.build(placement)
        dims = {name: tuple(sorted(dist.get_process_group_ranks(getattr(meshes, name).get_group())))
                for name in ("tp", "dp", "pp")}
        if meshes.embedding is not None:  # a tied embedding's end stages (LayoutMeshes.embedding)
            dims["embed"] = tuple(sorted(dist.get_process_group_ranks(meshes.embedding)))
        if meshes.kv_heads is not None:  # the TP ranks sharing a replicated kv head (LayoutMeshes.kv_heads)
            dims["kv"] = tuple(sorted(dist.get_process_group_ranks(meshes.kv_heads)))
        # cp's group may hold dp's ranks (dp=1): its collectives are told apart by group name.
        groups = {meshes.cp.group_name: "cp"} if meshes.cp is not None else {}
        if meshes.ep is not None:  # the experts' all-to-all group and the ranks holding the same experts
            dims["ep"] = tuple(sorted(dist.get_process_group_ranks(meshes.ep)))
            dims["edp"] = tuple(sorted(dist.get_process_group_ranks(meshes.expert_dp.get_group())))
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            try:
                trainer = ParallelTrainer(config, request.layout, rank, fake_shards(spec, placement, rank),
                                          meshes=meshes)
            except TrainingError as exc:
                raise EmulatorError(f"cannot trace {request.layout}: {exc}") from exc
            return _run_one_microbatch(trainer, request, stage, ml, dims, fake_mode, groups)
    finally:
        dist.destroy_process_group()


def _run_one_microbatch(trainer: ParallelTrainer, request: TraceRequest, stage: int, ml, dims,
                        fake_mode, groups: dict[str, str]) -> StageTrace:
    hidden = request.model_config.llm.hidden
    first, last = stage == 0, stage == ml.pp - 1
    static = trainer_static_bytes(trainer, ml.zero)
    positions = positions_between_stages(request, ml)
    recorder = OpRecorder()
    with ignoring_sharding_propagation(recorder), recorder:
        chunk = request.seq // ml.cp  # the rank's part of the sequence under context parallelism
        if first:
            x = torch.zeros(request.micro_batch, chunk, dtype=torch.long)
        else:
            x = torch.zeros(request.micro_batch, positions, hidden, dtype=torch.bfloat16, requires_grad=True)
        recorder.track(x)
        tag_accumulation(trainer.optimizer, recorder)
        out = trainer.stage(x)
        if last:
            out = cross_entropy_loss(out, torch.zeros(request.micro_batch, chunk, dtype=torch.long))
        activations = recorder.live
        recorder.set_phase("backward")
        hold_accumulated_grads(trainer.optimizer, request.micro_batches, recorder)
        out.backward(None if last else torch.empty_like(out))
        del out, x
        fwd_bwd_peak = recorder.peak
        grads_live = recorder.live
        recorder.set_phase("step")
        trainer.optimizer.step(trainer.config.lr_at(0))
    # Full recompute (Megatron's uniform method, one layer per checkpoint) keeps only each
    # layer's bf16 input, b*s*h*2 bytes a layer: Korthikanti et al. 2022 (arXiv 2205.05198),
    # section 4.3, "2sbhL" for full recomputation. The one layer being recomputed in the
    # backward and the head's logits are not added (the trainer cannot run recompute, so
    # this is the formula, not a traced figure). Selective recompute is left unset: this
    # program's attention is fused (flash) and keeps no s x s tensors to drop.
    layers = layer_stages(request.model_config.llm.layers, ml.pp).count(stage)
    memory = stage_memory(static, activations, fwd_bwd_peak, recorder.peak, grads_live,
                          layers * request.micro_batch * positions * hidden * 2)
    return build_stage_trace(recorder.records, stage, ml, dims, memory, request, hidden, groups=groups)

