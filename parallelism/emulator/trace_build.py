"""What the two traced programs (trace_parallel.py, trace_modules.py) share: the
request, fake shards of a rank's contract boxes, the trainer's static bytes, a traced
stage's memory, the symmetry classes of pipeline stages, and a StageTrace built from a
recorder's records."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.recorder import CommRecord, ComputeRecord
from parallelism.emulator.trace import CommOp, ComputeOp, StageMemory, StageTrace
from parallelism.engine.shards import DTYPES, LocalShard, box_shape, rank_boxes
from parallelism.layout.model_request import ModelConfig, NamesAModel, resolved_field
from parallelism.layout.placement import layer_stages, place

TRACER_VERSION = 17  # 2: activations_full; vpp traced as pp*vpp flat stages; 3: DTensor dispatch as host ops;
# 4: causal attention FLOPs, sequence parallelism; 5: matmul operand forms; 6: reduce-scatter bytes = its input;
# 7: in-place _foreach_ ops count the lists they write; 8: and those writes are not new memory (7 tracked them);
# 9: a tied embedding under pp > 1 (its gradient sum between the end stages, dim "embed");
# 10: kv heads replicated over tp (their gradient sum, dim "kv"); the trainer runs tp > kv heads
# 11: MoE layers traced (balanced routing on fake tensors), with tp (router and q/k-norm gradient sums
# over tp) and ep (all-to-all dispatch, dim "ep"; the experts' gradient sync over their replicas, "dp")
# 12: context parallelism (cp > 1): the chunk's K/V all-gather and its backward reduce-scatter
# (dim "cp", told apart from dp's group of the same ranks by group name), the last cp rank traced
# 13: a steady-state micro-batch when a step has several: the backward adds into the fp32 gradient
# buffers in place (trace_parallel._hold_accumulated_grads) instead of creating them; grad_sync_in_step
# 14: a memory-bound op's input dtype where it differs from its output's (ComputeOp.source)
# 15: the program's optimizer is torch's fused AdamW (parallelism/training/zero.py), one kernel
# 16: and zero=3's (FSDP2, parallelism/training/fsdp.py) too, on its DTensor shards
# 17: StageMemory.overlap, the gradients made as the backward frees activations (one micro-batch);
# allocation-only ops (recorder.ALLOCATE_ONLY) move no bytes
DIM_OF = {"edp": "dp"}


@dataclass(frozen=True)
class TraceRequest(NamesAModel):
    model: str
    layout: str
    micro_batch: int
    seq: int
    micro_batches: int
    gpus_per_node: int = 8
    sequence_parallel: bool = False
    model_config: ModelConfig | None = resolved_field()  # `model` resolved once (NamesAModel)
    model_error = EmulatorError

    def key(self) -> str:
        spec = self.tensors
        # the whole config, not only its name and size: a config.json edited in place (a window
        # turned on, another activation) is another program
        text = json.dumps({"v": TRACER_VERSION, "torch": torch.__version__, "model": spec.name,
                           "config": repr(self.model_config),
                           "params": spec.param_count, "layout": str(place(spec, self.layout).layout),
                           **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("layout", "model_config")}},
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def stage_classes(layers: int, stages: int) -> dict[tuple, list[int]]:
    """Symmetry classes of a pipeline's stages: ("llm", first, last, layers), each with the
    stages it stands for (data- and tensor-parallel replicas are symmetric)."""
    per = layer_stages(layers, stages)
    out: dict[tuple, list[int]] = {}
    for s in range(stages):
        out.setdefault(("llm", s == 0, s == stages - 1, per.count(s)), []).append(s)
    return out


def fake_shards(spec, placement, rank: int) -> dict:
    return {key: LocalShard(spec.tensors[key[0]], key[1], box,
                            torch.empty(box_shape(spec.tensors[key[0]], box), dtype=DTYPES[key[1]]))
            for key, box in rank_boxes(placement, rank).items()}


def trainer_static_bytes(trainer, zero: int) -> dict[str, int]:
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


def stage_memory(static: dict, activations: int, fwd_bwd_peak: int, step_peak: int, grads_live: int,
                 full: int) -> StageMemory:
    """A traced rank's memory: its static state, the activations one micro-batch keeps, the
    temporary above them at the peak, or the overlap below them where the gradients are made
    as the activations go (the traced peak under static + activations); `full`: the
    activations under full recompute (capped at the traced ones)."""
    grads = static["grads"]
    above = max(fwd_bwd_peak, step_peak) - activations - max(grads, grads_live)
    return StageMemory(params=static["params"], grads=grads, optimizer=static["optimizer"],
                       activations_per_microbatch=int(activations), temporary=int(max(0, above)),
                       activations_full=int(min(activations, full)), overlap=int(max(0, -above)))


def positions_between_stages(request: TraceRequest, ml) -> int:
    """Sequence positions a rank's hidden states hold between layers and stages: its cp
    chunk, split again over tp under sequence parallelism."""
    chunk = request.seq // ml.cp
    return chunk // ml.tp if request.sequence_parallel and ml.tp > 1 else chunk


def compute_op(r: ComputeRecord) -> ComputeOp:
    """The trace's op for one recorded kernel."""
    return ComputeOp(r.name, r.kind, r.flops, r.bytes, r.shape, r.dtype, r.form, r.role, r.source)


def build_stage_trace(records, stage: int, ml, dims, memory: StageMemory, request: TraceRequest, hidden: int,
                      offset: int = 0, groups: dict[str, str] | None = None) -> StageTrace:
    """A stage's ops from its recorded program (`dims`: the tp/dp/pp groups' ranks; `groups`:
    {process group name: dim} for groups whose ranks another dim's group has too, e.g. cp's
    and dp's when dp=1), with the pipeline sends to its neighbours (the module's ranks start at `offset`)."""
    groups = groups or {}
    # The experts' gradient sync over the ranks holding the same experts ("edp") is data-parallel
    # sync like dp's; an all-to-all is the experts' dispatch ("ep"), whose ranks may be dp's too.
    by_ranks = {ranks: DIM_OF.get(dim, dim) for dim, ranks in dims.items() if dim != "ep"}
    gpn = request.gpus_per_node
    phases: dict[str, list] = {"forward": [], "backward": [], "step": []}
    grad_sync, grad_after, param_sync, param_phase, param_at = [], [], [], [], []
    for r in records:
        ops = phases[r.phase]
        if isinstance(r, ComputeRecord):
            ops.append(compute_op(r))
            continue
        assert isinstance(r, CommRecord)
        dim = groups.get(r.group) if r.group else None
        if dim is None:
            dim = "ep" if r.kind == "all_to_all" and "ep" in dims else by_ranks.get(tuple(sorted(r.ranks)))
        if dim is None:
            raise EmulatorError(f"stage {stage}: a {r.kind} on ranks {r.ranks[:8]}... matches no "
                                f"tp/dp/pp/embed/kv/ep group")
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
    step_phase = list(grad_after)  # -1: issued in the optimizer step
    grad_after = [n_back if a < 0 else a for a in grad_after]
    # bf16 hidden states between stages (the rank's seq/tp slice under sequence parallelism)
    activation = float(request.micro_batch * positions_between_stages(request, ml) * hidden * 2)
    rank = offset + stage * ml.dp * ml.cp * ml.tp
    stride = ml.dp * ml.cp * ml.tp
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
                      grad_sync_in_step=bool(grad_sync) and all(a < 0 for a in step_phase),
                      param_sync_phase=tuple(param_phase), param_sync_at=tuple(param_at))
