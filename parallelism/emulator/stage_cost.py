"""What one (virtual) pipeline stage costs on a device (pure: no torch): its forward and
backward of one micro-batch as back-to-back ops on the compute stream (compute ops by the
device model, inline TP/CP/EP collectives by the network model), ZeRO-3 parameter gathers
prefetched one ahead on a side stream, the forward ops a recompute mode re-runs, the host
work around collectives and pipeline transfers, the data-parallel gradient buckets and
when the backward issues them, the optimizer and step-phase syncs. simulate.py puts these
on the timeline.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallelism.emulator.attention_kernels import CORE_ATTENTION_FORWARD
from parallelism.emulator.costs import op_seconds
from parallelism.emulator.devices import DeviceProfile
from parallelism.emulator.errors import require
from parallelism.emulator.grad_accumulation import first_backward
from parallelism.emulator.trace import CommOp, ComputeOp, Op, StageTrace

RECOMPUTE = ("none", "selective", "full")
PARTS = ("compute", "tp_comm", "dp_comm", "pp_comm")
BREAKDOWN = PARTS + ("bubble",)
_CATEGORY = {"tp": "tp_comm", "cp": "tp_comm", "ep": "tp_comm", "dp": "dp_comm", "pp": "pp_comm",
             "embed": "pp_comm",  # a tied embedding's gradient sum between the end stages
             "kv": "tp_comm"}  # replicated kv heads' gradient sum inside the TP group


# A stage's all-gather of what it received by scatter-gather (pipeline_p2p.py): part of the
# exchange, not of the layer, so recompute does not run it again.
RECEIVED_GATHER = "pp_gather_received"


def is_p2p(op: Op) -> bool:
    return isinstance(op, CommOp) and op.dim == "pp" and op.kind in ("send", "recv")


def category(op: Op) -> str:
    return "compute" if isinstance(op, ComputeOp) else _CATEGORY[op.dim]


def meetings(ops) -> int:
    """How many of `ops` are collectives inside the layers (tensor, context, expert
    parallelism's), where the ranks wait for each other (DeviceProfile.rendezvous_seconds)."""
    return sum(isinstance(op, CommOp) and not is_p2p(op) and category(op) == "tp_comm" for op in ops)


def recomputed_ops(stage: StageTrace, recompute: str) -> tuple[Op, ...]:
    """The forward ops a backward re-runs under a recompute mode."""
    require(recompute in RECOMPUTE, f"recompute={recompute!r} not in {RECOMPUTE}")
    if recompute == "full":
        return tuple(op for op in stage.forward if not is_p2p(op) and op.name != RECEIVED_GATHER)
    if recompute == "selective":
        return tuple(op for op in stage.forward if isinstance(op, ComputeOp)
                     and (op.kind == "attention" or op.name in CORE_ATTENTION_FORWARD))
    return ()


@dataclass
class Phase:
    seconds: float
    parts: dict[str, float]
    op_end: list[float]  # offset at which each op ends


def _run_phase(timed: list[tuple[float, str]], gathers: list[tuple[int, float, str]],
               overlap: float = 1.0) -> Phase:
    """Ops back to back; gather j must end before op gathers[j][0] starts; gather j+1 is
    issued when gather j is consumed (one ahead), gather 0 at the phase start. While an op
    runs, the gather in flight advances `overlap` seconds per second (the profile's
    comm_overlap); while the rank waits for it, at full speed."""
    t, parts, ends = 0.0, dict.fromkeys(PARTS, 0.0), []
    j, left = 0, (gathers[0][1] if gathers else 0.0)  # left: the in-flight gather's remaining seconds

    def consume(index: int) -> None:
        nonlocal t, j, left
        while j < len(gathers) and gathers[j][0] <= index:
            parts[gathers[j][2]] += left
            t += left
            j += 1
            left = gathers[j][1] if j < len(gathers) else 0.0

    for i, (seconds, category) in enumerate(timed):
        consume(i)
        t += seconds
        left = max(0.0, left - overlap * seconds)
        parts[category] += seconds
        ends.append(t)
    consume(len(timed))
    return Phase(t, parts, ends)




@dataclass
class StageCost:
    forward: Phase
    backward: Phase                    # a steady-state micro-batch's
    grad_ready: list[float]            # offset in the backward at which each bucket is issued
    grad_buckets: list[tuple[float, str]]
    f_send: float
    f_recv: float
    b_send: float
    b_recv: float
    optimizer: dict[str, float]
    step_syncs: list[tuple[float, str]]
    activations: int
    first_backward: Phase              # the step's first micro-batch's (grad_accumulation.first_backward)


def stage_cost(stage: StageTrace, profile: DeviceProfile, gpn: int, recompute: str) -> StageCost:
    cache: dict[int, float] = {}

    def seconds(op: Op) -> float:
        key = id(op)
        if key not in cache:
            cache[key] = op_seconds(op, profile, gpn)
        return cache[key]

    def timed(ops) -> list[tuple[float, str]]:
        return [(seconds(op), category(op)) for op in ops if not is_p2p(op)]

    def p2p(ops, kind: str) -> float:
        return sum(seconds(op) for op in ops if is_p2p(op) and op.kind == kind)

    def gathers(phase: str, shift: int = 0) -> list[tuple[int, float, str]]:
        return [(at + shift, seconds(op), category(op)) for at, op in stage.gathers(phase)]

    # p2p ops are not on the stream, so gather positions count the remaining ops only
    fwd_index = _index_without_p2p(stage.forward)
    bwd_index = _index_without_p2p(stage.backward)
    rec = timed(recomputed_ops(stage, recompute))
    fwd_gathers, bwd_gathers = gathers("forward"), gathers("backward")
    # Without comm streams (a CPU) a gather never advances while the rank computes: each one
    # runs where the program waits for it, in series.
    overlap = profile.comm_overlap if profile.comm_streams else 0.0
    forward = _run_phase(timed(stage.forward), [(fwd_index[a], s, c) for a, s, c in fwd_gathers], overlap)
    # Host work on the compute thread around the side-stream collectives (a phase's gathers
    # every micro-batch; the gradient buckets in every backward when they sync each
    # micro-batch, else once, before the optimizer) and around each pipeline send/recv
    # (p2p ops are the ones _index_without_p2p leaves out).
    host = profile.collective_host_seconds
    buckets = len(stage.grad_sync) * host
    meet = profile.rendezvous_seconds

    def backward_of(ops) -> Phase:  # (first_backward keeps the ops' count and places)
        phase = _run_phase(rec + timed(ops), [(bwd_index[a] + len(rec), s, c) for a, s, c in bwd_gathers], overlap)
        phase = _with_host(phase, len(bwd_gathers) * host + (buckets if stage.grad_sync_each_microbatch else 0.0))
        phase = _with_host(phase, (len(ops) - bwd_index[-1]) * profile.p2p_host_seconds, "pp_comm")
        return _with_host(phase, meetings((*recomputed_ops(stage, recompute), *ops)) * meet, "tp_comm")

    backward = backward_of(stage.backward)
    first = first_backward(stage.backward)
    first = backward if first == stage.backward else backward_of(first)
    forward = _with_host(forward, len(fwd_gathers) * host)
    forward = _with_host(forward, (len(stage.forward) - fwd_index[-1]) * profile.p2p_host_seconds, "pp_comm")
    forward = _with_host(forward, meetings(stage.forward) * meet, "tp_comm")
    ready = []
    for after in stage.grad_ready_after():
        i = len(rec) + bwd_index[after]
        ready.append(backward.op_end[i - 1] if i > 0 else 0.0)
    optimizer = dict.fromkeys(PARTS, 0.0)
    for s, c in timed(stage.optimizer):
        optimizer[c] += s
    if not stage.grad_sync_each_microbatch:
        optimizer["dp_comm"] += buckets
    optimizer["dp_comm"] += sum(p == "step" for p in stage.phases()) * host
    steps = [(seconds(op), category(op)) for op, p in zip(stage.param_sync, stage.phases()) if p == "step"]
    grad_buckets = [(seconds(op), category(op)) for op in stage.grad_sync]
    if not profile.comm_streams:  # the buckets block the thread that issues them: in series, no DP stream
        blocking = sum(s for s, _ in grad_buckets)
        if stage.grad_sync_each_microbatch:
            backward, first = _with_host(backward, blocking), _with_host(first, blocking)
        else:
            optimizer["dp_comm"] += blocking
        ready, grad_buckets = [], []
    return StageCost(forward, backward, ready, grad_buckets,
                      p2p(stage.forward, "send"), p2p(stage.forward, "recv"),
                      p2p(stage.backward, "send"), p2p(stage.backward, "recv"),
                      optimizer, steps, stage.memory.activations(recompute), first)


def _with_host(phase: Phase, seconds: float, category: str = "dp_comm") -> Phase:
    """The phase with `seconds` more on its thread at its end: host work for its
    communication, or collectives that block the thread (no comm streams)."""
    if not seconds:
        return phase
    parts = dict(phase.parts)
    parts[category] += seconds
    return Phase(phase.seconds + seconds, parts, phase.op_end)


def _index_without_p2p(ops: tuple[Op, ...]) -> list[int]:
    """index[i] = how many non-p2p ops precede position i (i in 0..len)."""
    out, n = [], 0
    for op in ops:
        out.append(n)
        n += not is_p2p(op)
    out.append(n)
    return out
