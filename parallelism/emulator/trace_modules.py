"""A multimodal model's program traced: `HeteroTrainer` (parallelism/training/hetero.py: its
encoder + projector with its TP plan, the LLM's `ImageTextStage`, the boundary
communicator, both optimizers: ShardedAdamW, or FSDP2's FullyShardedState for a zero=3
module, whose per-layer all-gathers and reduce-scatters are recorded like the decoder's),
a tied LLM embedding too (under pp > 1 the end stages' gradient sum, dim "embed"), any
layout of it (plain = the same layout for both modules, `encoder:...;llm:...` colocated,
or with `ranks=` non-colocated). One of tracer.py's two programs: the LLM is the Trace's
pipeline, the encoder its InputTrace.

Classes (each traced by one rank of the target world in a fresh process, on fake tensors):
- ("encoder",) (unpipelined, TP/DP replicas symmetric): its first rank runs the encoder
  forward over its share of the batch, the boundary forward, the boundary + encoder
  backward and the encoder optimizer step;
- the LLM's stage classes (trace_build.stage_classes): its first rank runs the boundary
  forward, one micro-batch forward + backward of its ImageTextStage (the first stage takes
  the image tokens before the text), the boundary backward and the LLM optimizer step.
  Interleaved (vpp > 1): the classes are the pp*vpp virtual stages'; virtual stage k is
  traced on pipeline rank k % pp, running the trainer's own chunk k (ImageTextStage.chunk:
  chunk 0 takes the image tokens), with that chunk's share of the rank's state as its
  static memory (the Trace's rule: a rank's static memory is the sum over its chunks) and
  its p2p sends' node spans those of its neighbours (trace_parallel.interleaved_p2p).
The boundary's point-to-point transfers (send/recv on the world group, in the plan's peer
order) are kept apart from the module's ops and checked against the plan's (boundary_ops,
which the trace holds for every rank); compute a module does inside another class's
process (a colocated rank's encoder in an LLM-stage process) is not recorded twice.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.recorder import CommRecord, OpRecorder, ignoring_sharding_propagation
from parallelism.emulator.trace_accumulation import hold_accumulated_grads, tag_accumulation
from parallelism.emulator.trace import CommOp, InputTrace, Trace, stage_from_dict, stage_to_dict
from parallelism.emulator.trace_parallel import interleaved_p2p
from parallelism.emulator.trace_build import (TRACER_VERSION, TraceRequest, build_stage_trace, fake_shards,
                                         positions_between_stages, stage_classes, stage_memory, trainer_static_bytes)
from parallelism.planner.activations import ActivationShape
from parallelism.layout.model_config import ModelConfig
from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import Placement, layer_stages, place
from parallelism.training.hetero import image_boundary
from parallelism.training.parallel import TrainConfig, TrainingError

# this program's part of the class keys; 2: the LLM's sequence parallelism; 3: its vpp and cp;
# 4: zero=3 (FSDP2) per module and a tied LLM embedding (its end stages' gradient sum, dim "embed");
# 5: the LLM's steady-state micro-batch and tagged gradient accumulation (trace_accumulation.py)
MODULES_VERSION = 5
CLASS = "class"  # what tracer.py's progress lines call a class


def global_batch(request: TraceRequest) -> int:
    return request.micro_batch * request.micro_batches * place(request.tensors, request.layout).modules["llm"].dp


def classes(request: TraceRequest) -> dict[tuple, list[int]]:
    """("encoder",) and the LLM's stage classes, each with the stages it stands for."""
    llm = place(request.tensors, request.layout).modules["llm"]
    return {("encoder",): [0], **stage_classes(request.model_config.llm.layers, llm.pp * llm.vpp)}


def class_key(request: TraceRequest, role: tuple) -> str:
    """A class's trace depends on its own module's layout only (the boundary's transfers are
    the plan's, derived for every rank by boundary_ops), so candidates of a search that
    share an encoder or LLM layout share its traces."""
    placement = place(request.tensors, request.layout)
    ml = placement.modules[role[0]]
    own = {k: getattr(ml, k) for k in ("tp", "pp", "dp", "cp", "ep", "vpp", "zero")}
    fields = ({"global_batch": global_batch(request)} if role[0] == "encoder" else
              {"offset": ml.offset, "micro_batch": request.micro_batch, "seq": request.seq,
               "micro_batches": request.micro_batches, "sequence_parallel": request.sequence_parallel})
    text = json.dumps({"v": (TRACER_VERSION, MODULES_VERSION), "torch": torch.__version__,
                       "model": request.model, "config": repr(request.model_config),
                       "params": request.tensors.param_count, "role": list(role),
                       "layout": own, "gpn": request.gpus_per_node, **fields}, sort_keys=True)
    return f"module-{role[0]}-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def label(key: tuple, member: int) -> str:
    return f"{key[0]} {member}"


def assemble(request: TraceRequest, parts: dict[tuple, dict]) -> Trace:
    placement = place(request.tensors, request.layout)
    enc, llm = placement.modules["encoder"], placement.modules["llm"]
    mc = request.model_config
    encoder = parts[("encoder",)]
    llm_stages = {s: dataclasses.replace(stage_from_dict(parts[key]["stage"]), stage=s)
                  for key, members in classes(request).items() if key[0] == "llm" for s in members}
    if llm.vpp > 1:
        llm_stages = {s: interleaved_p2p(st, llm, request.gpus_per_node, llm.offset) for s, st in llm_stages.items()}
    forward, backward = boundary_ops(placement, mc, global_batch(request), request.gpus_per_node)
    item = InputTrace(module="encoder", stage=stage_from_dict(encoder["stage"]), tp=enc.tp, dp=enc.dp, zero=enc.zero,
                      samples=encoder["samples"], tokens=mc.encoder.positions, colocated=enc.first_rank is None,
                      boundary_forward=tuple(forward[r] for r in sorted(forward)),
                      boundary_backward=tuple(backward[r] for r in sorted(backward)))
    return Trace(model=request.model, tp=llm.tp, pp=llm.pp, dp=llm.dp, micro_batches=request.micro_batches,
                 micro_batch_size=request.micro_batch, seq=request.seq + mc.encoder.positions,
                 zero=llm.zero, vpp=llm.vpp, cp=llm.cp, stages=tuple(llm_stages[s] for s in range(llm.pp * llm.vpp)),
                 inputs=(item,))


def boundary_ops(placement: Placement, mc: ModelConfig, batch: int, gpus_per_node: int) -> tuple[tuple, tuple]:
    """Every rank's point-to-point messages of the boundary's forward and backward exchange,
    from the plan HeteroTrainer's communicator runs (parallelism/planner/activations.py): one packed
    bf16 message per peer, sends sorted by peer then recvs, as run_exchange posts them. The
    tracer checks the traced ranks' recorded messages against these."""
    shape = ActivationShape(batch, mc.encoder.positions, mc.llm.hidden)
    plan = image_boundary(placement, shape)  # the LLM's cp ranks each receive the image tokens whole
    out = []
    for exchange in (plan.forward, plan.backward):
        b, messages = exchange.boxes, {}
        for i in range(len(exchange.src)):
            key = (int(exchange.src[i]), int(b.rank[i]))
            messages[key] = messages.get(key, 0) + int((b.a1[i] - b.a0[i]) * (b.b1[i] - b.b0[i])) * shape.hidden * 2
        per_rank: dict[int, list] = {}
        for (src, dst), size in sorted(messages.items()):
            nodes = len({src // gpus_per_node, dst // gpus_per_node})
            per_rank.setdefault(src, []).append(CommOp("boundary_send", "send", float(size), 2, nodes, "pp"))
        for (src, dst), size in sorted(messages.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            nodes = len({src // gpus_per_node, dst // gpus_per_node})
            per_rank.setdefault(dst, []).append(CommOp("boundary_recv", "recv", float(size), 2, nodes, "pp"))
        out.append({r: tuple(ops) for r, ops in per_rank.items()})
    return out[0], out[1]


def trace_class(request: TraceRequest, key: tuple, stage: int) -> dict:
    """{"stage": the StageTrace's dict, "samples": images its rank encodes} of one class,
    traced in this (fresh) process."""
    part = _trace_role(request, key[0], stage)
    return {"stage": stage_to_dict(part["stage"]), "samples": part["samples"]}


def _check_boundary(request: TraceRequest, rank: int, recorded_forward, recorded_backward) -> None:
    """The communicator's recorded messages must be the plan's (boundary_ops), which the
    emulator uses for every rank."""
    forward, backward = boundary_ops(place(request.tensors, request.layout), request.model_config, global_batch(request),
                                     request.gpus_per_node)
    for name, recorded, planned in (("forward", recorded_forward, forward), ("backward", recorded_backward, backward)):
        if tuple(recorded) != tuple(planned.get(rank, ())):
            raise EmulatorError(f"rank {rank}: the boundary's {name} messages {[(o.kind, o.bytes) for o in recorded]} "
                                f"differ from its plan's {[(o.kind, o.bytes) for o in planned.get(rank, ())]}")


def _group_ranks(mesh) -> dict[str, tuple[int, ...]]:
    return {name: tuple(sorted(dist.get_process_group_ranks(mesh[name].get_group()))) for name in ("tp", "dp", "pp")}


def _trace_role(request: TraceRequest, role: str, stage: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallelism.training.hetero import HeteroMeshes, HeteroTrainer

    spec = request.tensors
    placement = place(spec, request.layout)
    enc, llm = placement.modules["encoder"], placement.modules["llm"]
    # an LLM (virtual) stage k on pipeline rank k % pp; its last cp rank: the chunk at the end of
    # the sequence attends over every key and holds the most text (the step waits for it)
    rank = (enc.offset if role == "encoder" else
            llm.offset + (stage % llm.pp) * llm.dp * llm.cp * llm.tp + llm.tp * (llm.cp - 1))
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=placement.world, store=FakeStore())
    try:
        meshes = HeteroMeshes.build(placement)  # real (not fake) rank tensors: built outside FakeTensorMode
        config = TrainConfig(model=request.model, global_batch=global_batch(request), seq_len=request.seq,
                             micro_batches=request.micro_batches, sequence_parallel=request.sequence_parallel)
        with FakeTensorMode(allow_non_fake_inputs=True):
            try:
                trainer = HeteroTrainer(config, request.layout, rank, fake_shards(spec, placement, rank),
                                        meshes=meshes, check_plan=False)
            except (TrainingError, LayoutError) as exc:
                raise EmulatorError(f"cannot trace {request.layout}: {exc}") from exc
            if role == "encoder":
                return _encoder_part(trainer, request, _group_ranks(meshes.encoder), rank)
            dims = _group_ranks(meshes.llm)
            if meshes.kv_heads is not None:  # the TP ranks sharing a replicated kv head
                dims["kv"] = tuple(sorted(dist.get_process_group_ranks(meshes.kv_heads)))
            if meshes.embedding is not None:  # a tied embedding's two end stages (HeteroMeshes.embedding)
                dims["embed"] = tuple(sorted(dist.get_process_group_ranks(meshes.embedding)))
            return _llm_part(trainer, request, stage, dims, rank)
    finally:
        dist.destroy_process_group()


def _split_boundary(records, view_forward, view_backward, rank: int, gpn: int):
    """(module records, boundary forward ops, boundary backward ops): send/recv records are the
    boundary's (nothing else in this program sends point to point), matched in order with the
    plan's peers of this rank (run_exchange posts its sends, then its recvs, in plan order)."""
    module, boundary = [], {"boundary_f": [], "boundary_b": []}
    for r in records:
        if isinstance(r, CommRecord) and r.kind in ("send", "recv"):
            boundary["boundary_f" if r.phase in ("forward", "boundary_f") else "boundary_b"].append(r)
        elif r.phase in ("forward", "backward", "step"):
            module.append(r)

    def ops(recs, view) -> tuple[CommOp, ...]:
        peers = {"send": [p for p, _ in view.sends], "recv": [p for p, _ in view.recvs]}
        out = []
        for r in recs:
            peer = peers[r.kind].pop(0) if peers[r.kind] else rank
            out.append(CommOp(f"boundary_{r.kind}", r.kind, r.bytes, 2, len({rank // gpn, peer // gpn}), "pp"))
        return tuple(out)

    return module, ops(boundary["boundary_f"], view_forward), ops(boundary["boundary_b"], view_backward)


def _encoder_part(trainer, request: TraceRequest, dims, rank: int) -> dict:
    """The encoder rank's step: encoder forward over its share, boundary forward, boundary +
    encoder backward, encoder optimizer step."""
    v = trainer.mc.encoder
    static = trainer_static_bytes(SimpleNamespace(optimizer=trainer.enc_optimizer), trainer.enc_ml.zero)
    recorder = OpRecorder()
    with ignoring_sharding_propagation(recorder), recorder:
        x = trainer._encode()
        activations = recorder.live
        samples = int(x.shape[0])
        recorder.set_phase("boundary_f")
        received = trainer.boundary.apply(x)
        recorder.set_phase("backward")
        torch.autograd.backward(received, torch.zeros_like(received))
        del received, x
        fwd_bwd_peak, grads_live = recorder.peak, recorder.live
        recorder.set_phase("step")
        trainer.enc_optimizer.step(trainer.config.lr_at(0))
    b = trainer.boundary
    module, bf, bb = _split_boundary(recorder.records, b.forward_view, b.backward_view, rank, request.gpus_per_node)
    # full recompute keeps each layer's bf16 input (Korthikanti et al. 2022, "2sbhL"), as trace_parallel.py
    memory = stage_memory(static, activations, fwd_bwd_peak, recorder.peak, grads_live,
                     v.layers * samples * v.positions * v.hidden * 2)
    fake = TraceRequest(request.model, request.layout, max(samples, 1), v.positions, 1, request.gpus_per_node)
    stage = build_stage_trace(module, 0, trainer.enc_ml, dims, memory, fake, v.hidden)
    _check_boundary(request, rank, bf, bb)
    return {"stage": stage, "samples": samples}


def _chunk_state(optimizer, names: set[str], zero: int) -> SimpleNamespace:
    """The chunk's share of the rank's LLM optimizer state, as trainer_static_bytes reads it:
    FullyShardedState's shards and AdamW moments (zero=3), else ShardedAdamW's slots."""
    if zero == 3:
        params = {n: p for n, p in optimizer.params.items() if n in names}
        return SimpleNamespace(params=params, optimizer=SimpleNamespace(
            state={p: optimizer.optimizer.state[p] for p in params.values()}))
    return SimpleNamespace(slots=[s for s in optimizer.slots if s.name in names], moments=optimizer.moments)


def _llm_part(trainer, request: TraceRequest, stage: int, dims, rank: int) -> dict:
    """One LLM (virtual) stage's rank: boundary forward (the whole batch, as the trainer
    exchanges it), one micro-batch forward + backward of its ImageTextStage (its chunk
    `stage` when interleaved), boundary backward, LLM optimizer step."""
    mc, ml = trainer.mc, trainer.llm_ml
    virtual = ml.pp * ml.vpp
    module = trainer.chunks[stage // ml.pp]  # the stage itself when vpp = 1
    slots = {n for n, _ in module.named_parameters()}
    hidden, image = mc.llm.hidden, mc.encoder.positions
    positions = image + request.seq
    # the request as the LLM's stages see it: image + text positions (split over tp under SP)
    fake = TraceRequest(request.model, request.layout, request.micro_batch, positions, request.micro_batches,
                        request.gpus_per_node, request.sequence_parallel)
    between = positions_between_stages(fake, ml)
    mb = request.micro_batch
    first, last = stage == 0, stage == virtual - 1
    static = trainer_static_bytes(SimpleNamespace(optimizer=_chunk_state(trainer.llm_optimizer, slots, ml.zero)),
                                  ml.zero)
    x = trainer._encode()  # a colocated rank's encoder work: the encoder class records it
    recorder = OpRecorder()
    tag_accumulation(trainer.llm_optimizer, recorder)
    with ignoring_sharding_propagation(recorder), recorder:
        recorder.set_phase("boundary_f")
        received = trainer.boundary.apply(x)
        recorder.set_phase("forward")
        recorder.reset_peak()
        base = recorder.live
        if first:
            leaf = torch.zeros(mb, image, hidden, dtype=torch.bfloat16, requires_grad=True)
            tokens = torch.zeros(mb, request.seq, dtype=torch.long)
            recorder.track(leaf)
            recorder.track(tokens)
            out = module(tokens, leaf)
        else:
            h = torch.zeros(mb, between, hidden, dtype=torch.bfloat16, requires_grad=True)
            recorder.track(h)
            out = module(h)
        if last:
            out = trainer._loss(out, torch.zeros(mb, out.shape[1], dtype=torch.long))  # the chunk's text
        activations = recorder.live - base
        recorder.set_phase("backward")
        hold_accumulated_grads(trainer.llm_optimizer, request.micro_batches, recorder, slots)
        out.backward(None if last else torch.empty_like(out))
        del out
        if first:
            trainer._image_grad(leaf.grad)  # under cp: the sum of the cp ranks' parts
        fwd_bwd_peak, grads_live = recorder.peak - base, recorder.live - base
        recorder.set_phase("boundary_b")
        torch.autograd.backward(received, torch.zeros_like(received))
        del received
        recorder.set_phase("step")
        recorder.reset_peak()
        step_base = recorder.live
        trainer.llm_optimizer.step(trainer.config.lr_at(0))
        step_peak = recorder.peak - step_base
    b = trainer.boundary
    records, bf, bb = _split_boundary(recorder.records, b.forward_view, b.backward_view, rank, request.gpus_per_node)
    layers = layer_stages(mc.llm.layers, virtual).count(stage)
    memory = stage_memory(static, activations, fwd_bwd_peak, step_peak, grads_live, layers * mb * between * hidden * 2)
    flat = dataclasses.replace(ml, pp=virtual, vpp=1)  # the pp*vpp chunks' sends; interleaved_p2p fixes their spans
    # cp's group may hold dp's ranks (dp=1): its collectives are told apart by group name
    groups = {trainer.meshes.cp.group_name: "cp"} if trainer.meshes.cp is not None else {}
    traced = build_stage_trace(records, stage, flat, dims, memory, fake, hidden, offset=ml.offset, groups=groups)
    _check_boundary(request, rank, bf, bb)
    return {"stage": traced, "samples": 0}
