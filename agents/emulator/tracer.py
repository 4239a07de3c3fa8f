"""Trace the real training program for a target layout on fake tensors.

For each symmetry class of pipeline stages (first, last, and middle stages by layer
count; data- and tensor-parallel replicas are symmetric), one rank of the target world
joins torch's fake process group, builds the real `ParallelTrainer` (DTensor TP, the
ZeRO path or FSDP2) from fake shards of exactly its contract boxes, and runs one
micro-batch forward and backward and the optimizer step under FakeTensorMode, while an
OpRecorder writes down every op, every collective and the live tensor bytes. Nothing is
allocated or sent; the program, its shapes and its order are the real ones.

Static memory (params, grads, optimizer) is the size of the trainer's real tensors;
activations are what one micro-batch's forward leaves alive for its backward.

Interleaved layouts (vpp > 1): the trainer does not run them, but a virtual stage is an
ordinary pipeline stage holding one model chunk. A layout with vpp = v over pp ranks cuts
the layers into the same pp*v chunks as the plain layout with pp*v stages (placement.py:
the first L % (pp*v) chunks one layer longer), so the tracer traces the stage classes of
that flat layout (same tp, dp, zero, micro-batch; a fake world of tp*pp*v*dp ranks) and
returns them as the pp*v virtual stages of the interleaved Trace, with the p2p sends'
node spans recomputed for virtual stage k on pipeline rank k % pp.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from agents.emulator.errors import EmulatorError
from agents.emulator.recorder import CommRecord, ComputeRecord, OpRecorder, ignoring_sharding_propagation
from agents.emulator.trace import CommOp, ComputeOp, StageMemory, StageTrace, Trace, stage_from_dict, stage_to_dict
from agents.engine.shards import DTYPES, LocalShard, box_shape, rank_boxes
from agents.layout.catalog import get_config, get_model
from agents.layout.placement import layer_stages, place
from agents.training.parallel import LayoutMeshes, ParallelTrainer, TrainConfig, TrainingError, cross_entropy_loss

TRACER_VERSION = 8  # 2: activations_full; vpp traced as pp*vpp flat stages; 3: DTensor dispatch as host ops;
# 4: causal attention FLOPs, sequence parallelism; 5: matmul operand forms; 6: reduce-scatter bytes = its input;
# 7: in-place _foreach_ ops count the lists they write; 8: and those writes are not new memory (7 tracked them)


@dataclass(frozen=True)
class TraceRequest:
    model: str
    layout: str
    micro_batch: int
    seq: int
    micro_batches: int
    gpus_per_node: int = 8
    sequence_parallel: bool = False

    def key(self) -> str:
        spec = get_model(self.model)
        text = json.dumps({"v": TRACER_VERSION, "torch": torch.__version__, "model": spec.name,
                           "params": spec.param_count, "layout": str(place(spec, self.layout).layout),
                           **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"}},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_dir() -> Path:
    """DYNAPLANE_TRACE_CACHE, else the stack's var dir (agents run with DYNAPLANE_VAR_DIR),
    else ~/.cache/dynaplane/traces."""
    if os.environ.get("DYNAPLANE_TRACE_CACHE"):
        return Path(os.environ["DYNAPLANE_TRACE_CACHE"])
    if os.environ.get("DYNAPLANE_VAR_DIR"):
        return Path(os.environ["DYNAPLANE_VAR_DIR"]) / "traces"
    return Path.home() / ".cache" / "dynaplane" / "traces"


def trace(request: TraceRequest, *, use_cache: bool = True, progress=None) -> tuple[Trace, dict]:
    """The Trace of a configuration and facts about how it was made (classes traced,
    seconds, cache hit). Runs in this process on torch's fake process group."""
    path = cache_dir() / f"{request.key()}.json"
    if use_cache and path.exists():
        return Trace.from_json(path.read_text()), {"cached": True, "stages_traced": 0, "trace_seconds": 0.0}
    started = time.perf_counter()
    spec = get_model(request.model)
    placement = place(spec, request.layout)
    ml = next(iter(placement.modules.values()))
    virtual = ml.pp * ml.vpp
    # The request the stage processes trace: the flat layout when interleaved (see the module doc).
    flat = request if ml.vpp == 1 else dataclasses.replace(request, layout=flat_layout(placement))
    config = TrainConfig(model=request.model, global_batch=request.micro_batch * request.micro_batches * ml.dp,
                         seq_len=request.seq, micro_batches=request.micro_batches,
                         sequence_parallel=request.sequence_parallel)
    stages = layer_stages(spec.modules[-1].num_layers, virtual)
    classes: dict[tuple, list[int]] = {}
    for s in range(virtual):
        classes.setdefault((s == 0, s == virtual - 1, stages.count(s)), []).append(s)
    traced = _trace_classes(config, flat, classes, progress)
    by_stage = {s: dataclasses.replace(traced[key], stage=s) for key, members in classes.items() for s in members}
    ordered = tuple(by_stage[s] for s in range(virtual))
    if ml.vpp > 1:
        ordered = tuple(_interleaved_p2p(st, ml, request.gpus_per_node) for st in ordered)
    result = Trace(model=request.model, tp=ml.tp, pp=ml.pp, dp=ml.dp, micro_batches=request.micro_batches,
                   micro_batch_size=request.micro_batch, seq=request.seq, zero=ml.zero, vpp=ml.vpp,
                   stages=ordered)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(result.to_json())
        tmp.replace(path)
    return result, {"cached": False, "stages_traced": len(classes), "trace_seconds": time.perf_counter() - started}


def flat_layout(placement) -> str:
    """The vpp=1 layout whose pp*vpp stages are the chunks of an interleaved layout."""
    ml = next(iter(placement.modules.values()))
    return dataclasses.replace(placement.layout.modules[0], pp=ml.pp * ml.vpp, vpp=1).to_string(False)


def _interleaved_p2p(stage: StageTrace, ml, gpn: int) -> StageTrace:
    """Node spans of a virtual stage's p2p sends: virtual stage k runs on pipeline rank
    k % pp (first rank (k % pp)*dp*tp), its neighbours on (k +- 1) % pp."""
    k, stride = stage.stage, ml.dp * ml.tp
    rank = (k % ml.pp) * stride

    def fix(op):
        if not (isinstance(op, CommOp) and op.dim == "pp" and op.kind == "send"):
            return op
        peer = ((k + (1 if op.name == "pp_send_activations" else -1)) % ml.pp) * stride
        return dataclasses.replace(op, nodes=len({rank // gpn, peer // gpn}))

    return dataclasses.replace(stage, forward=tuple(fix(op) for op in stage.forward),
                               backward=tuple(fix(op) for op in stage.backward))


def in_fresh_processes(calls: dict, progress=None, what: str = "stage class") -> dict:
    """{key: (fn, args)} -> {key: fn(*args)}, each call in a fresh process (torch's
    process-group and mesh registries are global; a process forked from a server that has
    only imported torch, agents.engine.launch.rank_context, is a clean slate),
    DYNAPLANE_TRACE_WORKERS (2) at a time."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from agents.engine.launch import call_with_environ, rank_context

    if not calls:
        return {}
    workers = max(1, min(len(calls), int(os.environ.get("DYNAPLANE_TRACE_WORKERS", "2"))))
    out: dict = {}
    env = dict(os.environ)
    with ProcessPoolExecutor(workers, mp_context=rank_context(), max_tasks_per_child=1) as pool:
        futures = {pool.submit(call_with_environ, env, fn, *args): key for key, (fn, args) in calls.items()}
        for n, future in enumerate(as_completed(futures)):
            out[futures[future]] = future.result()
            if progress:
                progress(f"traced {what} {n + 1}/{len(calls)}")
    return out


def _trace_classes(config: TrainConfig, request: TraceRequest, classes: dict[tuple, list[int]], progress):
    """One fresh process per stage class."""
    calls = {key: (_trace_stage_dict, (config, request, members[0])) for key, members in classes.items()}
    return {key: stage_from_dict(d) for key, d in in_fresh_processes(calls, progress).items()}


def _trace_stage_dict(config: TrainConfig, request: TraceRequest, stage: int) -> dict:
    torch.set_num_threads(1)
    try:
        return stage_to_dict(_trace_stage(config, request, stage))
    except EmulatorError:
        raise
    except Exception as exc:  # torch errors may hold objects that cannot cross a process boundary
        raise EmulatorError(f"tracing {request.layout} (stage {stage}) failed: {type(exc).__name__}: {exc}") from None


def fake_shards(spec, placement, rank: int) -> dict:
    return {key: LocalShard(spec.tensors[key[0]], key[1], box,
                            torch.empty(box_shape(spec.tensors[key[0]], box), dtype=DTYPES[key[1]]))
            for key, box in rank_boxes(placement, rank).items()}


def _trace_stage(config: TrainConfig, request: TraceRequest, stage: int) -> StageTrace:
    spec = get_model(request.model)
    placement = place(spec, request.layout)
    ml = next(iter(placement.modules.values()))
    rank = stage * ml.dp * ml.tp  # tp_rank 0, dp_rank 0 of the stage
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
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            try:
                trainer = ParallelTrainer(config, request.layout, rank, fake_shards(spec, placement, rank),
                                          meshes=meshes)
            except TrainingError as exc:
                raise EmulatorError(f"cannot trace {request.layout}: {exc}") from exc
            return _run_one_microbatch(trainer, request, stage, ml, dims, fake_mode)
    finally:
        dist.destroy_process_group()


def _run_one_microbatch(trainer: ParallelTrainer, request: TraceRequest, stage: int, ml, dims,
                        fake_mode) -> StageTrace:
    hidden = get_config(request.model).llm.hidden
    first, last = stage == 0, stage == ml.pp - 1
    static = trainer_static_bytes(trainer, ml.zero)
    positions = _positions_between_stages(request, ml)
    recorder = OpRecorder()
    with ignoring_sharding_propagation(recorder), recorder:
        if first:
            x = torch.zeros(request.micro_batch, request.seq, dtype=torch.long)
        else:
            x = torch.zeros(request.micro_batch, positions, hidden, dtype=torch.bfloat16, requires_grad=True)
        recorder.track(x)
        out = trainer.stage(x)
        if last:
            out = cross_entropy_loss(out, torch.zeros(request.micro_batch, request.seq, dtype=torch.long))
        activations = recorder.live
        recorder.set_phase("backward")
        out.backward(None if last else torch.empty_like(out))
        del out, x
        fwd_bwd_peak = recorder.peak
        grads_live = recorder.live
        recorder.set_phase("step")
        trainer.optimizer.step(trainer.config.lr_at(0))
    activation_bytes = activations
    grads = static["grads"]
    temporary = max(0, max(fwd_bwd_peak, recorder.peak) - activation_bytes - max(grads, grads_live))
    # Full recompute (Megatron's uniform method, one layer per checkpoint) keeps only each
    # layer's bf16 input, b*s*h*2 bytes a layer: Korthikanti et al. 2022 (arXiv 2205.05198),
    # section 4.3, "2sbhL" for full recomputation. The one layer being recomputed in the
    # backward and the head's logits are not added (the trainer cannot run recompute, so
    # this is the formula, not a traced figure). Selective recompute is left unset: this
    # program's attention is fused (flash) and keeps no s x s tensors to drop.
    layers = layer_stages(get_config(request.model).llm.layers, ml.pp).count(stage)
    full = min(int(activation_bytes), layers * request.micro_batch * positions * hidden * 2)
    memory = StageMemory(params=static["params"], grads=grads, optimizer=static["optimizer"],
                         activations_per_microbatch=int(activation_bytes), temporary=int(temporary),
                         activations_full=full)
    return build_stage_trace(recorder.records, stage, ml, dims, memory, request, hidden)


def _positions_between_stages(request: TraceRequest, ml) -> int:
    """Sequence positions a rank's hidden states hold between layers and stages."""
    return request.seq // ml.tp if request.sequence_parallel and ml.tp > 1 else request.seq


def trainer_static_bytes(trainer: ParallelTrainer, zero: int) -> dict[str, int]:
    """Bytes of the trainer's own state tensors (exact: their sizes)."""
    def nbytes(t) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    opt = trainer.optimizer
    if zero == 3:
        params = sum(nbytes(p) for p in opt.params.values())  # fp32 shards = masters
        optimizer = sum(nbytes(s["exp_avg"]) + nbytes(s["exp_avg_sq"]) for s in opt.optimizer.state.values())
        grads = params  # FSDP2 reduce-scatters fp32 gradients into shards like the parameters
    else:
        params = sum(nbytes(s.local) for s in opt.slots)
        optimizer = sum(nbytes(s.master) + sum(nbytes(m) for m in opt.moments(s)) for s in opt.slots)
        grads = sum(s.local.numel() * 4 for s in opt.slots)  # the fp32 accumulation buffers
    return {"params": int(params), "grads": int(grads), "optimizer": int(optimizer)}


def build_stage_trace(records, stage: int, ml, dims, memory: StageMemory, request: TraceRequest, hidden: int) -> StageTrace:
    by_ranks = {ranks: dim for dim, ranks in dims.items()}
    gpn = request.gpus_per_node
    phases: dict[str, list] = {"forward": [], "backward": [], "step": []}
    grad_sync, grad_after, param_sync, param_phase, param_at = [], [], [], [], []
    for r in records:
        ops = phases[r.phase]
        if isinstance(r, ComputeRecord):
            ops.append(ComputeOp(r.name, r.kind, r.flops, r.bytes, r.shape, r.dtype, r.form))
            continue
        assert isinstance(r, CommRecord)
        dim = by_ranks.get(tuple(sorted(r.ranks)))
        if dim is None:
            raise EmulatorError(f"stage {stage}: a {r.kind} on ranks {r.ranks[:8]}... matches no tp/dp/pp group")
        op = CommOp(r.name, r.kind, r.bytes, len(r.ranks), len({x // gpn for x in r.ranks}), dim)
        if dim != "dp":
            ops.append(op)
        elif r.kind in ("all_reduce", "reduce_scatter"):
            grad_sync.append(op)
            grad_after.append(len(phases["backward"]) if r.phase == "backward" else -1)
        else:
            param_sync.append(op)
            param_phase.append(r.phase)
            param_at.append(len(ops) if r.phase != "step" else 0)
    n_back = len(phases["backward"])
    grad_after = [n_back if a < 0 else a for a in grad_after]
    # bf16 hidden states between stages (the rank's seq/tp slice under sequence parallelism)
    activation = float(request.micro_batch * _positions_between_stages(request, ml) * hidden * 2)
    rank = stage * ml.dp * ml.tp
    stride = ml.dp * ml.tp
    if stage < ml.pp - 1:
        phases["forward"].append(CommOp("pp_send_activations", "send", activation, 2,
                                        len({rank // gpn, (rank + stride) // gpn}), "pp"))
    if stage > 0:
        phases["backward"].append(CommOp("pp_send_gradients", "send", activation, 2,
                                         len({rank // gpn, (rank - stride) // gpn}), "pp"))
    return StageTrace(stage=stage, forward=tuple(phases["forward"]), backward=tuple(phases["backward"]),
                      optimizer=tuple(phases["step"]), grad_sync=tuple(grad_sync), param_sync=tuple(param_sync),
                      memory=memory, grad_sync_after=tuple(grad_after),
                      grad_sync_each_microbatch=ml.zero == 3,
                      param_sync_phase=tuple(param_phase), param_sync_at=tuple(param_at))


