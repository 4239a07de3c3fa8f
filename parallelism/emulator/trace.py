"""What a traced training step contains: the interface between the tracer and the simulator.

The tracer runs the real program for one rank per pipeline stage on fake tensors and
fills these frozen dataclasses; the simulator only reads them. Everything is per rank
(per TP/CP/DP replica, which are symmetric) and per micro-batch where it says so.

With the interleaved schedule (vpp > 1) `Trace.stages` holds one `StageTrace` per
*virtual* stage (model chunk), pp*vpp of them in model order: virtual stage k lives on
pipeline rank k % pp (chunk k // pp), as in Megatron and docs/contracts.md section 2. A rank's
static memory is the sum over its chunks.

A model is its modules: the last one (the LLM) is the pipeline of `Trace.stages`; the ones
before it (a multimodal model's encoder + projector) are `Trace.inputs`, each an unpipelined
module whose output feeds the pipeline's first stage across a boundary (`InputTrace`). A
decoder-only model is the case with no inputs.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Literal, Union

from parallelism.emulator.errors import EmulatorError, require

COMPUTE_KINDS = ("matmul", "attention", "memory", "host")  # host: a DTensor op's dispatch, no kernel
ROLES = ("", "grad_accumulate")
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")
DIMS = ("tp", "dp", "pp", "cp", "ep", "embed", "kv")  # embed: a tied embedding's two end stages;
# kv: the TP ranks sharing a replicated kv head (kv heads fewer than tp), which sum its gradient
DTYPES = ("bf16", "fp16", "fp32", "fp8")  # fp8: a run's FP8 GEMMs and casts (precision.py), never traced
SYNC_PHASES = ("forward", "backward", "step")
FORMAT_VERSION = 1


def _finite_nonneg(value: float, what: str) -> None:
    require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
            f"{what}={value!r} must be a finite number >= 0")


def _positive_int(value: int, what: str) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            f"{what}={value!r} must be a positive integer")


@dataclass(frozen=True, slots=True)
class ComputeOp:
    """One kernel. `bytes` is its memory traffic (reads + writes).

    `shape` conventions the cost model reads: matmul (m, n, k) or (batch, m, n, k);
    attention (batch, heads, seq_q, seq_kv, head_dim); anything else is ignored.
    `form` is a matmul's operand layout ("nt", "nn", "tn", ...; recorder.matmul_form), ""
    when unknown or not a matmul. `source` is the dtype a memory-bound op converts from where
    it reads floating tensors of another dtype than `dtype` (a bf16 gradient cast to or added
    into an fp32 buffer: source "bf16", dtype "fp32"), "" when it reads only `dtype`: on a
    CPU `fp32 += bf16` ran at 13 GB/s against 23 for `fp32 += fp32` (op_cases in calibrate_ops.py).
    """

    name: str
    kind: Literal["matmul", "attention", "memory"]
    flops: float
    bytes: float
    shape: tuple[int, ...] = ()
    dtype: str = "bf16"
    form: str = ""
    # What the program does with the op, where the tracer knows: "grad_accumulate" for the
    # adds of a micro-batch's gradients into the fp32 buffers (what a fused wgrad GEMM absorbs).
    role: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        require(self.source == "" or self.source in DTYPES,
                f"compute op {self.name!r}: source={self.source!r} not '' or in {DTYPES}")
        require(self.role in ROLES, f"compute op {self.name!r}: role={self.role!r} not in {ROLES}")
        require(self.kind in COMPUTE_KINDS, f"compute op {self.name!r}: kind={self.kind!r} not in {COMPUTE_KINDS}")
        _finite_nonneg(self.flops, f"compute op {self.name!r}: flops")
        _finite_nonneg(self.bytes, f"compute op {self.name!r}: bytes")
        require(self.dtype in DTYPES, f"compute op {self.name!r}: dtype={self.dtype!r} not in {DTYPES}")
        require(self.form == "" or (len(self.form) == 2 and set(self.form) <= set("ntg")),
                f"compute op {self.name!r}: form={self.form!r} must be '' or two of n/t/g")
        object.__setattr__(self, "shape", tuple(self.shape))
        require(all(isinstance(d, int) and d >= 0 for d in self.shape),
                f"compute op {self.name!r}: shape={self.shape!r} must hold integers >= 0")


@dataclass(frozen=True, slots=True)
class CommOp:
    """One collective on one rank. `bytes` is the per-rank buffer as torch's collective
    sees it: the input of all_reduce / reduce_scatter / all_to_all / send, the output of
    all_gather / recv, the buffer of broadcast. `nodes` is how many nodes the group spans."""

    name: str
    kind: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast"]
    bytes: float
    group_size: int
    nodes: int
    dim: Literal["tp", "dp", "pp", "cp", "ep", "embed", "kv"]

    def __post_init__(self) -> None:
        require(self.kind in COMM_KINDS, f"comm op {self.name!r}: kind={self.kind!r} not in {COMM_KINDS}")
        require(self.dim in DIMS, f"comm op {self.name!r}: dim={self.dim!r} not in {DIMS}")
        _finite_nonneg(self.bytes, f"comm op {self.name!r}: bytes")
        _positive_int(self.group_size, f"comm op {self.name!r}: group_size")
        _positive_int(self.nodes, f"comm op {self.name!r}: nodes")
        require(self.nodes <= self.group_size,
                f"comm op {self.name!r}: nodes={self.nodes} exceeds group_size={self.group_size}")


Op = Union[ComputeOp, CommOp]


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Bytes one rank of the stage holds. `activations_per_microbatch` is what one
    micro-batch's forward keeps for its backward without recompute; the two optional
    fields are the same under selective / full recompute (None: not traced, the
    simulator then falls back to the no-recompute value, an upper bound)."""

    params: int
    grads: int
    optimizer: int
    activations_per_microbatch: int
    temporary: int
    activations_selective: int | None = None
    activations_full: int | None = None
    # Gradient bytes made only as the backward frees activations: a rank running one
    # micro-batch (no gradients accumulated before it) peaks this far below static +
    # activations. FSDP2 reduce-scatters each layer's gradients into their fp32 shards as
    # that layer's activations go (0 where the traced peak already holds all gradients).
    overlap: int = 0

    def __post_init__(self) -> None:
        for key in ("params", "grads", "optimizer", "activations_per_microbatch", "temporary",
                    "activations_selective", "activations_full", "overlap"):
            value = getattr(self, key)
            if value is None and key.startswith("activations_"):
                continue
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                    f"memory {key}={value!r} must be an integer >= 0")

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer

    def activations(self, recompute: str) -> int:
        """Activation bytes per micro-batch under a recompute mode."""
        if recompute == "full" and self.activations_full is not None:
            return self.activations_full
        if recompute == "selective" and self.activations_selective is not None:
            return self.activations_selective
        return self.activations_per_microbatch


@dataclass(frozen=True, slots=True)
class StageTrace:
    """One (virtual) pipeline stage.

    forward / backward: one micro-batch's ops in program order, TP/CP/EP collectives
    inline (on the critical path); pp send/recv here become the transfer between stages.
    optimizer: the step's ops after the last backward.
    grad_sync: the data-parallel gradient reduction, bucket by bucket in issue order,
    overlappable with the backward. Bucket i is issued once `grad_sync_after[i]`
    backward ops of the micro-batch are done (default: spread evenly, the last bucket
    after the whole backward); only during the last micro-batch unless
    `grad_sync_each_microbatch` (FSDP2 without no_sync reduce-scatters every one).
    param_sync: parameter all-gathers. `param_sync_phase[i]` is "forward" / "backward"
    (ZeRO-3: run in every micro-batch, gather i must finish before op
    `param_sync_at[i]` of that phase, prefetched one ahead) or "step" (after the
    optimizer, e.g. ZeRO-1's all-gather; fully exposed). Default phase: "step"; default
    position: spread evenly over the phase's ops.
    """

    stage: int
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    optimizer: tuple[Op, ...]
    grad_sync: tuple[CommOp, ...]
    param_sync: tuple[CommOp, ...]
    memory: StageMemory
    grad_sync_after: tuple[int, ...] = ()
    grad_sync_each_microbatch: bool = False
    param_sync_phase: tuple[str, ...] = ()
    param_sync_at: tuple[int, ...] = ()
    # The program reduces gradients in its optimizer step, after the rank's last backward of
    # every chunk it holds (ShardedAdamW.step): with several chunks (vpp > 1) a chunk's buckets
    # wait for the other chunks' backwards too, rather than starting when its own ends.
    grad_sync_in_step: bool = False

    def __post_init__(self) -> None:
        for key in ("forward", "backward", "optimizer", "grad_sync", "param_sync", "grad_sync_after",
                    "param_sync_phase", "param_sync_at"):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        require(isinstance(self.stage, int) and self.stage >= 0, f"stage={self.stage!r} must be an integer >= 0")
        for key in ("forward", "backward", "optimizer"):
            for op in getattr(self, key):
                require(isinstance(op, (ComputeOp, CommOp)), f"stage {self.stage} {key}: {op!r} is not a ComputeOp or CommOp")
        for key in ("grad_sync", "param_sync"):
            for op in getattr(self, key):
                require(isinstance(op, CommOp), f"stage {self.stage} {key}: {op!r} is not a CommOp")
        require(isinstance(self.memory, StageMemory), f"stage {self.stage}: memory must be a StageMemory")
        n_back = len(self.backward)
        if self.grad_sync_after:
            require(len(self.grad_sync_after) == len(self.grad_sync),
                    f"stage {self.stage}: {len(self.grad_sync_after)} grad_sync_after values for "
                    f"{len(self.grad_sync)} grad_sync ops")
            require(all(isinstance(a, int) and 0 <= a <= n_back for a in self.grad_sync_after),
                    f"stage {self.stage}: grad_sync_after={self.grad_sync_after} must lie in 0..{n_back}")
        if self.param_sync_phase:
            require(len(self.param_sync_phase) == len(self.param_sync),
                    f"stage {self.stage}: {len(self.param_sync_phase)} param_sync_phase values for "
                    f"{len(self.param_sync)} param_sync ops")
            for phase in self.param_sync_phase:
                require(phase in SYNC_PHASES, f"stage {self.stage}: param_sync_phase {phase!r} not in {SYNC_PHASES}")
        if self.param_sync_at:
            require(len(self.param_sync_at) == len(self.param_sync),
                    f"stage {self.stage}: {len(self.param_sync_at)} param_sync_at values for "
                    f"{len(self.param_sync)} param_sync ops")
            for at, phase in zip(self.param_sync_at, self.phases()):
                limit = {"forward": len(self.forward), "backward": n_back}.get(phase)
                require(isinstance(at, int) and at >= 0 and (limit is None or at <= limit),
                        f"stage {self.stage}: param_sync_at={at!r} outside 0..{limit} of its {phase} phase")

    def phases(self) -> tuple[str, ...]:
        return self.param_sync_phase or ("step",) * len(self.param_sync)

    def grad_ready_after(self) -> tuple[int, ...]:
        """Backward ops done before each grad-sync bucket is issued."""
        if self.grad_sync_after:
            return self.grad_sync_after
        k, n = len(self.grad_sync), len(self.backward)
        return tuple(round((i + 1) * n / k) for i in range(k))

    def gathers(self, phase: str) -> list[tuple[int, CommOp]]:
        """(op index that needs it, op) for the param all-gathers of a phase, in issue order."""
        chosen = [(i, op) for i, (op, p) in enumerate(zip(self.param_sync, self.phases())) if p == phase]
        n_ops = len(self.forward if phase == "forward" else self.backward)
        out = []
        for j, (i, op) in enumerate(chosen):
            at = self.param_sync_at[i] if self.param_sync_at else (j * n_ops) // max(len(chosen), 1)
            out.append((at, op))
        return out


@dataclass(frozen=True, slots=True)
class InputTrace:
    """A module that runs before the pipeline and feeds its first stage (issue 8: a
    multimodal model's encoder + projector, unpipelined as the trainer runs it; TP/DP
    replicas symmetric).

    stage: one traced rank's whole step as a one-stage StageTrace: forward over its
    dp share of the global batch (`samples`), backward, optimizer, data-parallel gradient
    reduction. `tokens`: positions one sample becomes at the pipeline's input (image
    tokens). `colocated`: on the pipeline's own ranks (else on ranks of its own).
    boundary_forward / boundary_backward: the boundary's point-to-point transfers of the
    whole batch, one tuple per rank taking part (its sends and recvs). A rank's exchange
    takes max(its sends, its recvs) (links are full duplex); the exchange ends when the
    slowest rank's does.
    """

    module: str
    stage: StageTrace
    tp: int
    dp: int
    zero: int
    samples: int
    tokens: int
    colocated: bool
    boundary_forward: tuple[tuple[CommOp, ...], ...] = ()
    boundary_backward: tuple[tuple[CommOp, ...], ...] = ()

    def __post_init__(self) -> None:
        for key in ("boundary_forward", "boundary_backward"):
            object.__setattr__(self, key, tuple(tuple(ops) for ops in getattr(self, key)))
            for ops in getattr(self, key):
                for op in ops:
                    require(isinstance(op, CommOp) and op.kind in ("send", "recv"),
                            f"{self.module} {key}: {op!r} is not a send/recv CommOp")
        require(isinstance(self.stage, StageTrace), f"{self.module}: stage must be a StageTrace")
        for key in ("tp", "dp", "tokens"):
            _positive_int(getattr(self, key), f"{self.module} {key}")
        require(isinstance(self.samples, int) and self.samples >= 0,
                f"{self.module} samples={self.samples!r} must be an integer >= 0")

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("module", "tp", "dp", "zero", "samples", "tokens", "colocated")}
        out["stage"] = stage_to_dict(self.stage)
        for key in ("boundary_forward", "boundary_backward"):
            out[key] = [[op_to_dict(op) for op in ops] for ops in getattr(self, key)]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "InputTrace":
        data = dict(data)
        data["stage"] = stage_from_dict(data["stage"])
        for key in ("boundary_forward", "boundary_backward"):
            data[key] = tuple(tuple(op_from_dict(op) for op in ops) for ops in data.get(key, ()))
        return cls(**data)


@dataclass(frozen=True, slots=True)
class Trace:
    """A traced step of one configuration: layout, batch shape and its stages; `inputs`:
    the modules feeding the pipeline (none for a decoder-only model). With inputs, `seq`
    is the positions the pipeline runs (input tokens + text)."""

    model: str
    tp: int
    pp: int
    dp: int
    micro_batches: int
    micro_batch_size: int
    seq: int
    stages: tuple[StageTrace, ...]
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    inputs: tuple[InputTrace, ...] = ()
    # Each pipeline send keeps its sender busy until it is done (pipeline_p2p.py, Megatron's
    # synchronous exchange); False: sends are asynchronous, as the program's.
    p2p_blocking: bool = False
    # The step's parameter all-gathers (ZeRO-1/2's, phase "step") run beside the next step's
    # first forward, each chunk's before that forward needs it (param_gather.py, Megatron-Core's
    # overlap_param_gather); False: after the optimizer, exposed, as the program's.
    param_gather_overlapped: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        for item in self.inputs:
            require(isinstance(item, InputTrace), f"inputs: {item!r} is not an InputTrace")
        for key in ("tp", "pp", "vpp", "dp", "cp", "ep", "micro_batches", "micro_batch_size", "seq"):
            _positive_int(getattr(self, key), key)
        require(self.zero in (0, 1, 2, 3), f"zero={self.zero!r} must be 0, 1, 2 or 3")
        require((self.dp * self.cp) % self.ep == 0, f"ep={self.ep} must divide dp*cp={self.dp * self.cp}")
        require(self.vpp == 1 or self.pp > 1, f"vpp={self.vpp} needs pp > 1 (pp={self.pp})")
        require(len(self.stages) == self.pp * self.vpp,
                f"{len(self.stages)} stages traced, the layout has pp*vpp={self.pp * self.vpp}")
        for i, stage in enumerate(self.stages):
            require(isinstance(stage, StageTrace), f"stages[{i}] is not a StageTrace")
            require(stage.stage == i, f"stages[{i}] has stage={stage.stage}; stages must be in order 0..")

    @property
    def world(self) -> int:
        """The pipeline's ranks (an input module on ranks of its own adds its InputTrace.world)."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def global_batch(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    # --- JSON (the tracer caches traces on disk) ----------------------------------
    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("stages", "inputs")}
        out["stages"] = [stage_to_dict(s) for s in self.stages]
        out["inputs"] = [i.to_dict() for i in self.inputs]
        out["version"] = FORMAT_VERSION
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> "Trace":
        data = dict(data)
        version = data.pop("version", FORMAT_VERSION)
        require(version == FORMAT_VERSION, f"trace format version={version!r}, this code reads {FORMAT_VERSION}")
        stages = tuple(stage_from_dict(s) for s in data.pop("stages"))
        inputs = tuple(InputTrace.from_dict(i) for i in data.pop("inputs", ()))
        return cls(stages=stages, inputs=inputs, **data)

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EmulatorError(f"trace is not JSON: {exc}") from exc
        return cls.from_dict(data)


def op_to_dict(op: Op) -> dict:
    return {"op": "compute" if isinstance(op, ComputeOp) else "comm", **asdict(op)}


def op_from_dict(data: dict) -> Op:
    data = dict(data)
    which = data.pop("op", None)
    if which == "compute":
        return ComputeOp(**data)
    if which == "comm":
        return CommOp(**data)
    raise EmulatorError(f"op type {which!r} is neither 'compute' nor 'comm'")


def stage_to_dict(stage: StageTrace) -> dict:
    out = {f: getattr(stage, f) for f in ("stage", "grad_sync_after", "grad_sync_each_microbatch",
                                          "param_sync_phase", "param_sync_at", "grad_sync_in_step")}
    for key in ("forward", "backward", "optimizer", "grad_sync", "param_sync"):
        out[key] = [op_to_dict(op) for op in getattr(stage, key)]
    out["memory"] = asdict(stage.memory)
    return out


def stage_from_dict(data: dict) -> StageTrace:
    data = dict(data)
    for key in ("forward", "backward", "optimizer", "grad_sync", "param_sync"):
        data[key] = tuple(op_from_dict(op) for op in data.get(key, ()))
    data["memory"] = StageMemory(**data["memory"])
    return StageTrace(**data)


__all__ = ["ComputeOp", "CommOp", "InputTrace", "Op", "StageMemory", "StageTrace", "Trace"]
