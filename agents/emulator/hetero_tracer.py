"""Trace a multimodal model's heterogeneous (or plain) layout from the real program.

As tracer.py does for decoder-only layouts: one rank of the target world per symmetry class
joins torch's fake process group in a fresh process and builds the real `HeteroTrainer`
(agents/training/hetero.py: its encoder + projector with its TP plan, the LLM's
`ImageTextStage`, the boundary communicator, both ShardedAdamW optimizers) from fake shards
of exactly its contract boxes, then runs its part of a step under FakeTensorMode while an
OpRecorder writes down every op, collective and live byte. Classes:
- the encoder (unpipelined, TP/DP replicas symmetric): its first rank runs the encoder
  forward over its share of the batch, the boundary forward, the boundary + encoder
  backward and the encoder optimizer step;
- each LLM stage class (first, last, middle by layer count): its first rank runs the
  boundary forward, one micro-batch forward + backward of its ImageTextStage (the first
  stage takes the image tokens before the text), the boundary backward and the LLM
  optimizer step.
The boundary's point-to-point transfers (send/recv on the world group, in the plan's peer
order) are kept apart from the module's ops; compute a module does inside another role's
process (a colocated rank's encoder in an LLM-stage process) is not recorded twice.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from agents.emulator.errors import EmulatorError
from agents.emulator.hetero_trace import HeteroTrace
from agents.emulator.recorder import CommRecord, OpRecorder, ignoring_sharding_propagation
from agents.emulator.trace import CommOp, StageMemory, Trace, stage_from_dict, stage_to_dict
from agents.emulator.tracer import (TRACER_VERSION, TraceRequest, fake_shards, build_stage_trace, trainer_static_bytes,
                                    cache_dir, in_fresh_processes)
from agents.layout.catalog import get_config, get_model
from agents.layout.errors import LayoutError
from agents.layout.activations import ActivationShape, plan_boundary
from agents.layout.placement import Placement, layer_stages, place
from agents.training.parallel import TrainConfig, TrainingError

HETERO_TRACER_VERSION = 1


@dataclass(frozen=True)
class HeteroTraceRequest:
    model: str
    layout: str
    global_batch: int
    micro_batch: int
    seq: int                 # text tokens per sample (the LLM sees image tokens + text)
    micro_batches: int
    gpus_per_node: int = 8

    def key(self) -> str:
        spec = get_model(self.model)
        text = json.dumps({"v": (TRACER_VERSION, HETERO_TRACER_VERSION), "torch": torch.__version__,
                           "model": spec.name, "params": spec.param_count, "layout": str(place(spec, self.layout).layout),
                           **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"}},
                          sort_keys=True)
        return "hetero-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def roles(request: HeteroTraceRequest) -> dict[tuple, list[int]]:
    """Symmetry classes: ("encoder",) and one ("llm", first, last, layers) per LLM stage class,
    each with the LLM stages it stands for."""
    placement = place(get_model(request.model), request.layout)
    llm = placement.modules["llm"]
    stages = layer_stages(get_config(request.model).llm.layers, llm.pp)
    out: dict[tuple, list[int]] = {("encoder",): [0]}
    for s in range(llm.pp):
        out.setdefault(("llm", s == 0, s == llm.pp - 1, stages.count(s)), []).append(s)
    return out


def _role_key(request: HeteroTraceRequest, role: tuple) -> str:
    """A class's trace depends on its own module's layout only (the boundary's transfers are
    the plan's, derived for every rank by boundary_ops), so candidates of a search that
    share an encoder or LLM layout share its traces."""
    placement = place(get_model(request.model), request.layout)
    ml = placement.modules[role[0]]
    own = {k: getattr(ml, k) for k in ("tp", "pp", "dp", "cp", "ep", "vpp", "zero")}
    fields = ({"global_batch": request.global_batch} if role[0] == "encoder" else
              {"offset": ml.offset, "micro_batch": request.micro_batch, "seq": request.seq,
               "micro_batches": request.micro_batches})
    text = json.dumps({"v": (TRACER_VERSION, HETERO_TRACER_VERSION), "torch": torch.__version__,
                       "model": request.model, "params": get_model(request.model).param_count, "role": list(role),
                       "layout": own, "gpn": request.gpus_per_node, **fields}, sort_keys=True)
    return f"hetero-{role[0]}-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def boundary_ops(placement: Placement, batch: int, gpus_per_node: int) -> tuple[tuple, tuple]:
    """Every rank's point-to-point messages of the boundary's forward and backward exchange,
    from the plan HeteroTrainer's communicator runs (agents/layout/activations.py): one packed
    bf16 message per peer, sends sorted by peer then recvs, as run_exchange posts them. The
    tracer checks the traced ranks' recorded messages against these."""
    mc = get_config(placement.model.name)
    shape = ActivationShape(batch, mc.encoder.positions, mc.llm.hidden)
    plan = plan_boundary(placement.modules["encoder"], placement.modules["llm"], shape)
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


def trace_hetero(request: HeteroTraceRequest, *, use_cache: bool = True, progress=None) -> tuple[HeteroTrace, dict]:
    started = time.perf_counter()
    placement = place(get_model(request.model), request.layout)
    enc, llm = placement.modules["encoder"], placement.modules["llm"]
    mc = get_config(request.model)
    classes = roles(request)
    parts, missing = {}, {}
    for key, members in classes.items():
        path = cache_dir() / f"{_role_key(request, key)}.json"
        if use_cache and path.exists():
            parts[key] = _part_from_dict(json.loads(path.read_text()))
        else:
            missing[key] = members
    for key, part in _trace_roles(request, missing, progress).items():
        parts[key] = part
        if use_cache:
            path = cache_dir() / f"{_role_key(request, key)}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(_part_to_dict(part)))
            tmp.replace(path)
    encoder = parts[("encoder",)]
    llm_stages = {s: dataclasses.replace(parts[key]["stage"], stage=s)
                  for key, members in classes.items() if key[0] == "llm" for s in members}
    llm_trace = Trace(model=request.model, tp=llm.tp, pp=llm.pp, dp=llm.dp, micro_batches=request.micro_batches,
                      micro_batch_size=request.micro_batch, seq=request.seq + mc.encoder.positions,
                      zero=llm.zero, stages=tuple(llm_stages[s] for s in range(llm.pp)))
    forward, backward = boundary_ops(placement, request.global_batch, request.gpus_per_node)
    result = HeteroTrace(model=request.model, layout=str(placement.layout), colocated=enc.first_rank is None,
                         encoder=encoder["stage"], encoder_tp=enc.tp, encoder_dp=enc.dp, encoder_zero=enc.zero,
                         encoder_samples=encoder["samples"], image_tokens=mc.encoder.positions,
                         llm=llm_trace, boundary_forward=tuple(forward[r] for r in sorted(forward)),
                         boundary_backward=tuple(backward[r] for r in sorted(backward)))
    return result, {"cached": not missing, "stages_traced": len(missing), "classes": len(classes),
                    "trace_seconds": time.perf_counter() - started}


def _part_to_dict(part: dict) -> dict:
    return {"stage": stage_to_dict(part["stage"]), "samples": part["samples"]}


def _part_from_dict(data: dict) -> dict:
    return {"stage": stage_from_dict(data["stage"]), "samples": data["samples"]}


def _trace_roles(request: HeteroTraceRequest, classes: dict[tuple, list[int]], progress) -> dict[tuple, dict]:
    """One fresh process per class."""
    calls = {key: (_trace_role_dict, (request, key[0], members[0])) for key, members in classes.items()}
    return {key: _part_from_dict(d) for key, d in in_fresh_processes(calls, progress, "class").items()}


def _trace_role_dict(request: HeteroTraceRequest, role: str, stage: int) -> dict:
    torch.set_num_threads(1)
    try:
        part = _trace_role(request, role, stage)
    except EmulatorError:
        raise
    except Exception as exc:  # torch errors may hold objects that cannot cross a process boundary
        raise EmulatorError(f"tracing {request.layout} ({role} {stage}) failed: {type(exc).__name__}: {exc}") from None
    return _part_to_dict(part)


def _check_boundary(request: HeteroTraceRequest, rank: int, recorded_forward, recorded_backward) -> None:
    """The communicator's recorded messages must be the plan's (boundary_ops), which the
    emulator uses for every rank."""
    forward, backward = boundary_ops(place(get_model(request.model), request.layout), request.global_batch,
                                     request.gpus_per_node)
    for name, recorded, planned in (("forward", recorded_forward, forward), ("backward", recorded_backward, backward)):
        if tuple(recorded) != tuple(planned.get(rank, ())):
            raise EmulatorError(f"rank {rank}: the boundary's {name} messages {[(o.kind, o.bytes) for o in recorded]} "
                                f"differ from its plan's {[(o.kind, o.bytes) for o in planned.get(rank, ())]}")


def _group_ranks(mesh) -> dict[str, tuple[int, ...]]:
    return {name: tuple(sorted(dist.get_process_group_ranks(mesh[name].get_group()))) for name in ("tp", "dp", "pp")}


def _trace_role(request: HeteroTraceRequest, role: str, stage: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from agents.training.hetero import HeteroMeshes, HeteroTrainer

    spec = get_model(request.model)
    placement = place(spec, request.layout)
    enc, llm = placement.modules["encoder"], placement.modules["llm"]
    rank = enc.offset if role == "encoder" else llm.offset + stage * llm.dp * llm.tp
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=placement.world, store=FakeStore())
    try:
        meshes = HeteroMeshes.build(placement)  # real (not fake) rank tensors: built outside FakeTensorMode
        config = TrainConfig(model=request.model, global_batch=request.global_batch, seq_len=request.seq,
                             micro_batches=request.micro_batches)
        with FakeTensorMode(allow_non_fake_inputs=True):
            try:
                trainer = HeteroTrainer(config, request.layout, rank, fake_shards(spec, placement, rank),
                                        meshes=meshes, check_plan=False)
            except (TrainingError, LayoutError) as exc:
                raise EmulatorError(f"cannot trace {request.layout}: {exc}") from exc
            if role == "encoder":
                return _encoder_part(trainer, request, _group_ranks(meshes.encoder), rank)
            return _llm_part(trainer, request, stage, _group_ranks(meshes.llm), rank)
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


def _memory(static: dict, activations: int, fwd_bwd_peak: int, step_peak: int, grads_live: int, full: int) -> StageMemory:
    grads = static["grads"]
    temporary = max(0, max(fwd_bwd_peak, step_peak) - activations - max(grads, grads_live))
    return StageMemory(params=static["params"], grads=grads, optimizer=static["optimizer"],
                       activations_per_microbatch=int(activations), temporary=int(temporary),
                       activations_full=int(min(activations, full)))


def _encoder_part(trainer, request: HeteroTraceRequest, dims, rank: int) -> dict:
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
    # full recompute keeps each layer's bf16 input (Korthikanti et al. 2022, "2sbhL"), as tracer.py
    memory = _memory(static, activations, fwd_bwd_peak, recorder.peak, grads_live,
                     v.layers * samples * v.positions * v.hidden * 2)
    fake = TraceRequest(request.model, request.layout, max(samples, 1), v.positions, 1, request.gpus_per_node)
    stage = build_stage_trace(module, 0, trainer.enc_ml, dims, memory, fake, v.hidden)
    _check_boundary(request, rank, bf, bb)
    return {"stage": stage, "samples": samples}


def _llm_part(trainer, request: HeteroTraceRequest, stage: int, dims, rank: int) -> dict:
    """One LLM stage rank: boundary forward (the whole batch, as the trainer exchanges it), one
    micro-batch forward + backward of its ImageTextStage, boundary backward, LLM optimizer step."""
    mc, ml = trainer.mc, trainer.llm_ml
    hidden, image = mc.llm.hidden, mc.encoder.positions
    positions = image + request.seq
    mb = request.micro_batch
    first, last = stage == 0, stage == ml.pp - 1
    static = trainer_static_bytes(SimpleNamespace(optimizer=trainer.llm_optimizer), ml.zero)
    x = trainer._encode()  # a colocated rank's encoder work: the encoder class records it
    recorder = OpRecorder()
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
            out = trainer.llm_stage(tokens, leaf)
        else:
            h = torch.zeros(mb, positions, hidden, dtype=torch.bfloat16, requires_grad=True)
            recorder.track(h)
            out = trainer.llm_stage(h)
        if last:
            from agents.training.image_text_stage import text_loss
            out = text_loss(out, torch.zeros(mb, request.seq, dtype=torch.long))
        activations = recorder.live - base
        recorder.set_phase("backward")
        out.backward(None if last else torch.empty_like(out))
        del out
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
    module, bf, bb = _split_boundary(recorder.records, b.forward_view, b.backward_view, rank, request.gpus_per_node)
    layers = layer_stages(mc.llm.layers, ml.pp).count(stage)
    memory = _memory(static, activations, fwd_bwd_peak, step_peak, grads_live, layers * mb * positions * hidden * 2)
    fake = TraceRequest(request.model, request.layout, mb, positions, request.micro_batches, request.gpus_per_node)
    traced = build_stage_trace(module, stage, _Flat(ml), dims, memory, fake, hidden)
    _check_boundary(request, rank, bf, bb)
    return {"stage": _offset_p2p(traced, ml, stage, request.gpus_per_node), "samples": 0}


@dataclass(frozen=True)
class _Flat:
    """The module layout as tracer.build_stage_trace reads it (pp, dp, tp, zero)."""
    tp: int
    pp: int
    dp: int
    zero: int

    def __init__(self, ml) -> None:
        for key in ("tp", "pp", "dp", "zero"):
            object.__setattr__(self, key, getattr(ml, key))


def _offset_p2p(stage_trace, ml, stage: int, gpn: int):
    """Node spans of the pipeline sends with the module's first rank (non-colocated LLMs do
    not start at rank 0)."""
    stride = ml.dp * ml.tp
    rank = ml.offset + stage * stride

    def fix(op):
        if not (isinstance(op, CommOp) and op.dim == "pp" and op.kind == "send"):
            return op
        peer = rank + (stride if op.name == "pp_send_activations" else -stride)
        return dataclasses.replace(op, nodes=len({rank // gpn, peer // gpn}))

    return dataclasses.replace(stage_trace, forward=tuple(fix(op) for op in stage_trace.forward),
                               backward=tuple(fix(op) for op in stage_trace.backward))
