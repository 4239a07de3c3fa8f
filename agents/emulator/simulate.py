"""Discrete-event simulation of one training step across the pipeline stages.

One rank per pipeline stage is simulated: TP/CP/DP/EP replicas are symmetric (their
collectives take the same time on every member), so the cost grows with pp*vpp*m, not
with the number of GPUs.

Per rank, a compute stream runs its schedule (schedule.py) action by action. An action
is one micro-batch's forward or backward of one (virtual) stage:
- its ops run in program order: compute ops by the device model, inline collectives
  (TP/CP/EP, any non-p2p op) by the network model, on the critical path;
- ZeRO-3 parameter all-gathers of the phase run on a side stream, prefetched one ahead
  (gather j+1 is issued when gather j is consumed); the compute stalls only when a
  gather is late;
- recompute "full" re-runs the whole forward (ops and inline collectives) at the start
  of each backward, "selective" re-runs the forward's attention ops (Megatron's
  selective recompute of core attention). Per-layer interleaving of the recomputation
  is not modelled, only its cost;
- pp send/recv ops are not run on the stream: they are the transfer time on the edge
  to the next stage (forward) or previous stage (backward), max(sender's sends,
  receiver's recvs). Sends are asynchronous; the receiver waits.
An action starts when its rank is free and its input has arrived. Data-parallel
gradient buckets are issued on a DP stream as the backward reaches their op (last
micro-batch only, or every micro-batch) and run one after another; the optimizer waits
for the stream to drain, then step-phase syncs (ZeRO-1 all-gather) run exposed. A device
without comm streams (profile.comm_streams False: a CPU) runs every data-parallel
collective in series where the program issues it: gathers before the op that needs them,
the buckets at the end of the backward (every micro-batch) or before the optimizer.
The step ends when the last rank ends.

Breakdown of a rank (sums to step_seconds exactly): compute (all compute ops incl.
recompute and optimizer), tp_comm (inline TP/CP/EP collectives), dp_comm (gather stalls,
exposed gradient sync, inline DP and step syncs), pp_comm (waits while an input was in
flight, inline pp ops), bubble (every other idle moment, incl. waiting for the slowest
rank). The result's breakdown is the busiest rank's (least bubble).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from agents.emulator.costs import op_seconds
from agents.emulator.devices import DeviceProfile
from agents.emulator.errors import require
from agents.emulator.schedule import rank_orders
from agents.emulator.trace import CommOp, ComputeOp, Op, StageTrace, Trace

RECOMPUTE = ("none", "selective", "full")
PARTS = ("compute", "tp_comm", "dp_comm", "pp_comm")
BREAKDOWN = PARTS + ("bubble",)
_CATEGORY = {"tp": "tp_comm", "cp": "tp_comm", "ep": "tp_comm", "dp": "dp_comm", "pp": "pp_comm"}


@dataclass(frozen=True, slots=True)
class Event:
    """One interval on a rank's timeline (for charts)."""

    rank: int
    kind: str            # forward, backward, grad_sync, optimizer, param_sync
    start: float
    end: float
    micro_batch: int = -1
    stage: int = -1      # virtual stage


@dataclass(frozen=True)
class StageResult:
    """One pipeline rank: memory in bytes, its time breakdown in seconds."""

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int     # peak bytes of activations held (micro-batches in flight)
    temporary: int
    peak: int
    in_flight: int       # most micro-batch forwards (per chunk) held at once
    breakdown: dict[str, float]
    end_seconds: float


@dataclass(frozen=True)
class SimResult:
    step_seconds: float
    breakdown: dict[str, float]
    per_stage: tuple[StageResult, ...]
    critical_stage: int
    peak_bytes: int
    hbm_bytes: int
    events: tuple[Event, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        return out


# --- per-stage costs ----------------------------------------------------------------
def _is_p2p(op: Op) -> bool:
    return isinstance(op, CommOp) and op.dim == "pp" and op.kind in ("send", "recv")


def _category(op: Op) -> str:
    return "compute" if isinstance(op, ComputeOp) else _CATEGORY[op.dim]


def recomputed_ops(stage: StageTrace, recompute: str) -> tuple[Op, ...]:
    """The forward ops a backward re-runs under a recompute mode."""
    require(recompute in RECOMPUTE, f"recompute={recompute!r} not in {RECOMPUTE}")
    if recompute == "full":
        return tuple(op for op in stage.forward if not _is_p2p(op))
    if recompute == "selective":
        return tuple(op for op in stage.forward if isinstance(op, ComputeOp) and op.kind == "attention")
    return ()


@dataclass
class _Phase:
    seconds: float
    parts: dict[str, float]
    op_end: list[float]  # offset at which each op ends


def _run_phase(timed: list[tuple[float, str]], gathers: list[tuple[int, float, str]],
               overlap: float = 1.0) -> _Phase:
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
    return _Phase(t, parts, ends)


def _overlapped_end(begin: float, seconds: float, compute_end: float, overlap: float) -> float:
    """When a collective issued at `begin` ends if the rank computes until `compute_end`:
    it advances `overlap` seconds per second of that compute, then at full speed."""
    window = max(0.0, compute_end - begin)
    if overlap > 0 and seconds <= overlap * window:
        return begin + seconds / overlap
    return max(begin, compute_end) + seconds - overlap * window


@dataclass
class StageCost:
    forward: _Phase
    backward: _Phase
    grad_ready: list[float]            # offset in the backward at which each bucket is issued
    grad_buckets: list[tuple[float, str]]
    f_send: float
    f_recv: float
    b_send: float
    b_recv: float
    optimizer: dict[str, float]
    step_syncs: list[tuple[float, str]]
    activations: int


def stage_cost(stage: StageTrace, profile: DeviceProfile, gpn: int, recompute: str) -> StageCost:
    cache: dict[int, float] = {}

    def seconds(op: Op) -> float:
        key = id(op)
        if key not in cache:
            cache[key] = op_seconds(op, profile, gpn)
        return cache[key]

    def timed(ops) -> list[tuple[float, str]]:
        return [(seconds(op), _category(op)) for op in ops if not _is_p2p(op)]

    def p2p(ops, kind: str) -> float:
        return sum(seconds(op) for op in ops if _is_p2p(op) and op.kind == kind)

    def gathers(phase: str, shift: int = 0) -> list[tuple[int, float, str]]:
        return [(at + shift, seconds(op), _category(op)) for at, op in stage.gathers(phase)]

    # p2p ops are not on the stream, so gather positions count the remaining ops only
    fwd_index = _index_without_p2p(stage.forward)
    bwd_index = _index_without_p2p(stage.backward)
    rec = timed(recomputed_ops(stage, recompute))
    fwd_gathers, bwd_gathers = gathers("forward"), gathers("backward")
    # Without comm streams (a CPU) a gather never advances while the rank computes: each one
    # runs where the program waits for it, in series.
    overlap = profile.comm_overlap if profile.comm_streams else 0.0
    forward = _run_phase(timed(stage.forward), [(fwd_index[a], s, c) for a, s, c in fwd_gathers], overlap)
    backward = _run_phase(rec + timed(stage.backward),
                          [(bwd_index[a] + len(rec), s, c) for a, s, c in bwd_gathers], overlap)
    # Host work on the compute thread around the side-stream collectives (a phase's gathers
    # every micro-batch; the gradient buckets in every backward when they sync each
    # micro-batch, else once, before the optimizer) and around each pipeline send/recv
    # (p2p ops are the ones _index_without_p2p leaves out).
    host = profile.collective_host_seconds
    buckets = len(stage.grad_sync) * host
    forward = _with_host(forward, len(fwd_gathers) * host)
    backward = _with_host(backward, len(bwd_gathers) * host + (buckets if stage.grad_sync_each_microbatch else 0.0))
    forward = _with_host(forward, (len(stage.forward) - fwd_index[-1]) * profile.p2p_host_seconds, "pp_comm")
    backward = _with_host(backward, (len(stage.backward) - bwd_index[-1]) * profile.p2p_host_seconds, "pp_comm")
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
    steps = [(seconds(op), _category(op)) for op, p in zip(stage.param_sync, stage.phases()) if p == "step"]
    grad_buckets = [(seconds(op), _category(op)) for op in stage.grad_sync]
    if not profile.comm_streams:  # the buckets block the thread that issues them: in series, no DP stream
        blocking = sum(s for s, _ in grad_buckets)
        if stage.grad_sync_each_microbatch:
            backward = _with_host(backward, blocking)
        else:
            optimizer["dp_comm"] += blocking
        ready, grad_buckets = [], []
    return StageCost(forward, backward, ready, grad_buckets,
                      p2p(stage.forward, "send"), p2p(stage.forward, "recv"),
                      p2p(stage.backward, "send"), p2p(stage.backward, "recv"),
                      optimizer, steps, stage.memory.activations(recompute))


def _with_host(phase: _Phase, seconds: float, category: str = "dp_comm") -> _Phase:
    """The phase with `seconds` more on its thread at its end: host work for its
    communication, or collectives that block the thread (no comm streams)."""
    if not seconds:
        return phase
    parts = dict(phase.parts)
    parts[category] += seconds
    return _Phase(phase.seconds + seconds, parts, phase.op_end)


def _index_without_p2p(ops: tuple[Op, ...]) -> list[int]:
    """index[i] = how many non-p2p ops precede position i (i in 0..len)."""
    out, n = [], 0
    for op in ops:
        out.append(n)
        n += not _is_p2p(op)
    out.append(n)
    return out


# --- the step -------------------------------------------------------------------------
def simulate(trace: Trace, profile: DeviceProfile, gpus_per_node: int = 8, recompute: str = "none",
             record_events: bool = False, input_ready: tuple[float, ...] | None = None) -> SimResult:
    """`input_ready[i]`: when micro-batch i's input reaches the first stage (default 0: all at
    the start); a heterogeneous layout's encoder feeds the LLM this way (hetero_sim.py)."""
    require(isinstance(trace, Trace), f"trace must be a Trace, got {type(trace).__name__}")
    require(isinstance(profile, DeviceProfile), f"profile must be a DeviceProfile, got {type(profile).__name__}")
    require(isinstance(gpus_per_node, int) and gpus_per_node >= 1,
            f"gpus_per_node={gpus_per_node!r} must be a positive integer")
    require(recompute in RECOMPUTE, f"recompute={recompute!r} not in {RECOMPUTE}")
    pp, vpp, m = trace.pp, trace.vpp, trace.micro_batches
    require(input_ready is None or (len(input_ready) == m and all(t >= 0 for t in input_ready)),
            f"input_ready must hold {m} times >= 0, one per micro-batch")
    K = pp * vpp
    costs = [stage_cost(s, profile, gpus_per_node, recompute) for s in trace.stages]
    orders = rank_orders(pp, vpp, m)
    fwd_edge = [max(costs[k].f_send, costs[k + 1].f_recv) for k in range(K - 1)]
    bwd_edge = [max(costs[k + 1].b_send, costs[k].b_recv) for k in range(K - 1)]

    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    ptr = [0] * pp
    parts = [dict.fromkeys(PARTS, 0.0) for _ in range(pp)]
    dp_stream = [0.0] * pp
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while ptr[r] < len(orders[r]):
                kind, mb, chunk = orders[r][ptr[r]]
                k = chunk * pp + r
                if kind == "F":
                    dep, edge = (("F", mb, k - 1), fwd_edge[k - 1]) if k > 0 else (None, 0.0)
                else:
                    dep, edge = (("B", mb, k + 1), bwd_edge[k]) if k < K - 1 else (("F", mb, k), 0.0)
                if dep is not None and dep not in end:
                    break
                arrival = end[dep] + edge if dep is not None else (input_ready[mb] if input_ready else 0.0)
                start = max(free[r], arrival)
                parts[r]["pp_comm"] += min(start - free[r], edge)
                phase = costs[k].forward if kind == "F" else costs[k].backward
                for key, value in phase.parts.items():
                    parts[r][key] += value
                end[(kind, mb, k)] = free[r] = start + phase.seconds
                if record_events:
                    events.append(Event(r, "forward" if kind == "F" else "backward", start, free[r], mb, k))
                if kind == "B" and (mb == m - 1 or trace.stages[k].grad_sync_each_microbatch):
                    for offset, (seconds, _) in zip(costs[k].grad_ready, costs[k].grad_buckets):
                        begin = max(dp_stream[r], start + offset)
                        dp_stream[r] = _overlapped_end(begin, seconds, free[r], profile.comm_overlap)
                        if record_events:
                            events.append(Event(r, "grad_sync", begin, dp_stream[r], mb, k))
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # a schedule bug, not a user error
            raise RuntimeError(f"pipeline schedule deadlocked at {[orders[r][ptr[r]] for r in range(pp) if ptr[r] < len(orders[r])]}")

    rank_end = []
    for r in range(pp):
        t = max(free[r], dp_stream[r])
        parts[r]["dp_comm"] += t - free[r]
        chunks = [costs[c * pp + r] for c in range(vpp)]
        optimizer = sum(sum(c.optimizer.values()) for c in chunks)
        for c in chunks:
            for key, value in c.optimizer.items():
                parts[r][key] += value
        if record_events and optimizer:
            events.append(Event(r, "optimizer", t, t + optimizer))
        t += optimizer
        for c in chunks:
            for seconds, category in c.step_syncs:
                parts[r][category] += seconds
                if record_events:
                    events.append(Event(r, "param_sync", t, t + seconds))
                t += seconds
        rank_end.append(t)
    step = max(rank_end)

    per_stage = []
    for r in range(pp):
        breakdown = dict(parts[r])
        breakdown["bubble"] = max(0.0, step - sum(breakdown.values()))
        per_stage.append(_memory(trace, r, orders[r], costs, breakdown, rank_end[r]))
    critical = min(range(pp), key=lambda r: per_stage[r].breakdown["bubble"])
    peak = max(s.peak for s in per_stage)
    return SimResult(step, dict(per_stage[critical].breakdown), tuple(per_stage), critical, peak,
                     profile.hbm_bytes, tuple(sorted(events, key=lambda e: (e.start, e.rank))))


def _memory(trace: Trace, r: int, order, costs: list[StageCost], breakdown: dict[str, float],
            end_seconds: float) -> StageResult:
    """Static state summed over the rank's chunks; activations from walking its order
    (a forward allocates its micro-batch's activations, the backward frees them)."""
    pp = trace.pp
    chunks = [trace.stages[c * pp + r] for c in range(trace.vpp)]
    held = count = peak_held = peak_count = 0
    for kind, _, chunk in order:
        act = costs[chunk * pp + r].activations
        sign = 1 if kind == "F" else -1
        held += sign * act
        count += sign
        peak_held, peak_count = max(peak_held, held), max(peak_count, count)
    params = sum(s.memory.params for s in chunks)
    grads = sum(s.memory.grads for s in chunks)
    optimizer = sum(s.memory.optimizer for s in chunks)
    temporary = max(s.memory.temporary for s in chunks)
    return StageResult(r, params, grads, optimizer, peak_held, temporary,
                       params + grads + optimizer + peak_held + temporary, peak_count, breakdown, end_seconds)
