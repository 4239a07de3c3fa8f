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

A trace with an input module (`Trace.inputs`: a multimodal model's encoder, trace.py) adds
it to the step. Its rank's traced step (forward over its whole share, backward, gradient
reduction, optimizer) is costed like a stage (stage_cost.py); the boundary's exchanges take,
on each rank, max(its sends, its recvs), and the slowest rank's. Where it runs is data:
- **colocated** (on the pipeline's ranks, as HeteroTrainer runs it): input forward for the
  batch, boundary forward, the pipeline's step, boundary backward, input backward, its
  gradient reduction and optimizer, one after the other on every rank: the step is their
  sum. Memory: both modules' state plus the input's activations of the whole share (held
  while the pipeline runs) on every rank, over the pipeline's per-stage peak.
- **non-colocated** (on ranks of its own): the input module streams its share in `chunks`
  pieces (one per micro-batch when the batch divides, else fewer): piece i's forward ends
  at (i+1) F/c, its tokens reach the first stage bf/c later and feed the micro-batches that
  hold those samples (`input_ready`); piece i's backward runs when the first stage's
  backward of its last micro-batch plus bb/c has arrived, after all input forwards. The
  step is the critical path of the two: max(pipeline step, input end). Memory per module on
  its own ranks. `chunks=1` is what HeteroTrainer runs today (whole batch, then the LLM,
  then the encoder backward). A piece costs 1/c of the whole share's traced time (kernel
  efficiency at 1/c of the rows is not re-evaluated).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from parallelism.emulator.costs import op_seconds
from parallelism.emulator.devices import DeviceProfile
from parallelism.emulator.errors import require
from parallelism.emulator.schedule import rank_orders
from parallelism.emulator.stage_cost import BREAKDOWN, PARTS, RECOMPUTE, StageCost, stage_cost
from parallelism.emulator.trace import InputTrace, Trace

PIPELINE = "llm"  # the pipelined module's name: a model's last module


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
    inputs: int = 0      # bytes colocated input modules hold on this rank (in `peak`)
    overlap: int = 0     # bytes `peak` sits below the parts above (StageMemory.overlap)


@dataclass(frozen=True)
class SimResult:
    """With input modules: `breakdown` is the critical module's busiest rank's (both
    modules' when colocated), `phases` the input module's step and the pipeline's
    (seconds), `input_memory` an input module's rank ({module: bytes by kind, peak})."""

    step_seconds: float
    breakdown: dict[str, float]
    per_stage: tuple[StageResult, ...]
    critical_stage: int
    peak_bytes: int
    hbm_bytes: int
    events: tuple[Event, ...] = field(default=())
    phases: dict[str, float] = field(default_factory=dict)
    chunks: int = 1
    critical_module: str = PIPELINE
    input_memory: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        return out


def _overlapped_end(begin: float, seconds: float, compute_end: float, overlap: float) -> float:
    """When a collective issued at `begin` ends if the rank computes until `compute_end`:
    it advances `overlap` seconds per second of that compute, then at full speed."""
    window = max(0.0, compute_end - begin)
    if overlap > 0 and seconds <= overlap * window:
        return begin + seconds / overlap
    return max(begin, compute_end) + seconds - overlap * window



# --- the step -------------------------------------------------------------------------
def simulate(trace: Trace, profile: DeviceProfile, gpus_per_node: int = 8, recompute: str = "none",
             record_events: bool = False, input_ready: tuple[float, ...] | None = None,
             chunks: int | None = None) -> SimResult:
    """The step of any model's trace. `input_ready[i]`: when micro-batch i's input reaches
    the first stage (default 0: all at the start; without input modules only). `chunks`:
    pieces a non-colocated input module streams its share in (default: input_chunks)."""
    require(isinstance(trace, Trace), f"trace must be a Trace, got {type(trace).__name__}")
    require(isinstance(profile, DeviceProfile), f"profile must be a DeviceProfile, got {type(profile).__name__}")
    require(isinstance(gpus_per_node, int) and gpus_per_node >= 1,
            f"gpus_per_node={gpus_per_node!r} must be a positive integer")
    require(recompute in RECOMPUTE, f"recompute={recompute!r} not in {RECOMPUTE}")
    if not trace.inputs:
        require(chunks in (None, 1), f"chunks={chunks!r}: the trace has no input module to stream")
        return _pipeline(trace, profile, gpus_per_node, recompute, record_events, input_ready)
    require(input_ready is None, "input_ready is derived from the trace's input module")
    require(len(trace.inputs) == 1, f"{len(trace.inputs)} input modules: one (the encoder) is modelled")
    return _with_input(trace, trace.inputs[0], profile, gpus_per_node, recompute, record_events, chunks)


def _pipeline(trace: Trace, profile: DeviceProfile, gpus_per_node: int, recompute: str, record_events: bool,
              input_ready: tuple[float, ...] | None) -> SimResult:
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
    # Overlapped parameter gathers (param_gather.py): the last step's, issued at its end, run on
    # the DP stream from this step's start in chunk order; a chunk's first forward ends no
    # earlier than its gathers (the steady state of one step after another).
    gathered: dict[int, float] = {}
    if trace.param_gather_overlapped:
        for r in range(pp):
            for k in (c * pp + r for c in range(vpp)):
                dp_stream[r] += sum(seconds for seconds, _ in costs[k].step_syncs)
                gathered[k] = dp_stream[r]
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
                # (micro-batch 0's backward is each stage's first: it makes the fp32 gradient buffers)
                phase = costs[k].forward if kind == "F" else costs[k].first_backward if mb == 0 else costs[k].backward
                for key, value in phase.parts.items():
                    parts[r][key] += value
                finish = start + phase.seconds
                if kind == "F" and mb == 0 and gathered.get(k, 0.0) > finish:  # waits for its parameters
                    parts[r]["dp_comm"] += gathered[k] - finish
                    finish = gathered[k]
                end[(kind, mb, k)] = free[r] = finish
                if trace.p2p_blocking:  # the sender waits for its send (pipeline_p2p.py)
                    blocked = costs[k].f_send if kind == "F" else costs[k].b_send
                    free[r] += blocked
                    parts[r]["pp_comm"] += blocked
                if record_events:
                    events.append(Event(r, "forward" if kind == "F" else "backward", start, free[r], mb, k))
                if kind == "B" and (mb == m - 1 or trace.stages[k].grad_sync_each_microbatch) \
                        and not trace.stages[k].grad_sync_in_step:
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

    for r in range(pp):  # buckets the optimizer step reduces: after the rank's last backward
        for k in (c * pp + r for c in range(vpp)):
            if trace.stages[k].grad_sync_in_step:
                for seconds, _ in costs[k].grad_buckets:
                    begin = max(dp_stream[r], free[r])
                    dp_stream[r] = begin + seconds
                    if record_events:
                        events.append(Event(r, "grad_sync", begin, dp_stream[r], m - 1, k))
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
        for c in chunks if not trace.param_gather_overlapped else ():
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
        per_stage.append(_memory(trace, r, orders[r], costs, breakdown, rank_end[r], recompute))
    critical = min(range(pp), key=lambda r: per_stage[r].breakdown["bubble"])
    peak = max(s.peak for s in per_stage)
    return SimResult(step, dict(per_stage[critical].breakdown), tuple(per_stage), critical, peak,
                     profile.hbm_bytes, tuple(sorted(events, key=lambda e: (e.start, e.rank))))


def _memory(trace: Trace, r: int, order, costs: list[StageCost], breakdown: dict[str, float],
            end_seconds: float, recompute: str = "none") -> StageResult:
    """Static state summed over the rank's chunks; activations from walking its order
    (a forward allocates its micro-batch's activations, the backward frees them). The
    traced overlap (StageMemory.overlap) comes off the peak only where it was traced: one
    chunk, one micro-batch in flight, the activations as traced (no recompute)."""
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
    overlap = chunks[0].memory.overlap if len(chunks) == 1 and peak_count <= 1 and recompute == "none" else 0
    return StageResult(r, params, grads, optimizer, peak_held, temporary,
                       params + grads + optimizer + peak_held + temporary - overlap, peak_count, breakdown,
                       end_seconds, overlap=overlap)


# --- input modules --------------------------------------------------------------------
def boundary_seconds(ranks, profile: DeviceProfile, gpus_per_node: int) -> float:
    """The exchange ends when the slowest rank's does; a rank sends and receives at once."""
    worst = 0.0
    for ops in ranks:
        sends = sum(op_seconds(op, profile, gpus_per_node) for op in ops if op.kind == "send")
        recvs = sum(op_seconds(op, profile, gpus_per_node) for op in ops if op.kind == "recv")
        worst = max(worst, sends, recvs)
    return worst


def input_chunks(samples: int, micro_batches: int, colocated: bool) -> int:
    """Pieces a non-colocated input module streams its share in: the largest divisor of the
    pipeline's micro-batch count that divides the share (1 when colocated)."""
    if colocated or samples == 0:
        return 1
    return max(c for c in range(1, micro_batches + 1) if micro_batches % c == 0 and samples % c == 0)


def input_memory(item: InputTrace, recompute: str) -> dict[str, int]:
    """Bytes one rank of an input module holds: its state, the activations of its whole
    share, its temporary; and their peak."""
    mem = item.stage.memory
    out = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
           "activations": mem.activations(recompute), "temporary": mem.temporary}
    out["peak"] = sum(out.values())
    return out


def _with_input(trace: Trace, item: InputTrace, profile: DeviceProfile, gpus_per_node: int, recompute: str,
                record_events: bool, chunks: int | None) -> SimResult:
    m = trace.micro_batches
    c = chunks if chunks is not None else input_chunks(item.samples, m, item.colocated)
    require(isinstance(c, int) and c >= 1 and m % c == 0, f"chunks={c!r} must be a positive divisor of {m} micro-batches")
    require(c == 1 or not item.colocated, f"a colocated {item.module} runs its share in one piece (chunks=1)")
    name = item.module
    enc = stage_cost(item.stage, profile, gpus_per_node, recompute)
    bf = boundary_seconds(item.boundary_forward, profile, gpus_per_node)
    bb = boundary_seconds(item.boundary_backward, profile, gpus_per_node)
    sync = sum(s for s, _ in enc.grad_buckets)
    optimizer = sum(enc.optimizer.values()) + sum(s for s, _ in enc.step_syncs)
    phases = {f"{name}_forward": enc.forward.seconds, "boundary_forward": bf, f"{name}_backward": enc.backward.seconds,
              "boundary_backward": bb, f"{name}_grad_sync": sync, f"{name}_optimizer": optimizer}
    enc_parts = dict.fromkeys(PARTS, 0.0)
    for part in (enc.forward.parts, enc.backward.parts, enc.optimizer):
        for key, value in part.items():
            enc_parts[key] += value
    enc_parts["dp_comm"] += sync + sum(s for s, cat in enc.step_syncs if cat == "dp_comm")
    enc_parts["pp_comm"] += bf + bb  # the boundary's transfers

    if item.colocated:
        llm = _pipeline(trace, profile, gpus_per_node, recompute, record_events, None)
        step = llm.step_seconds + sum(phases.values())
        breakdown = {k: llm.breakdown[k] + enc_parts.get(k, 0.0) for k in BREAKDOWN}
        critical = f"{PIPELINE}+{name}"
    else:
        f, b = enc.forward.seconds / c, enc.backward.seconds / c
        ready = [(j * c // m + 1) * f + bf / c for j in range(m)]
        llm = _pipeline(trace, profile, gpus_per_node, recompute, True, tuple(ready))
        first_b = {e.micro_batch: e.end for e in llm.events if e.kind == "backward" and e.stage == 0}
        t = c * f
        for i in range(c):
            grads_back = max(first_b[j] for j in range(m) if j * c // m == i) + bb / c
            t = max(t, grads_back) + b
        encoder_end = t + sync + optimizer
        step = max(llm.step_seconds, encoder_end)
        phases[f"{PIPELINE}_step"] = llm.step_seconds
        phases[f"{name}_end"] = encoder_end
        llm_parts = dict(llm.breakdown)
        llm_parts["bubble"] += step - llm.step_seconds
        enc_parts["bubble"] = max(0.0, step - sum(enc_parts.values()))
        # the module on the critical path: the one that ends the step
        breakdown, critical = ((llm_parts, PIPELINE) if llm.step_seconds >= encoder_end
                               else ({k: enc_parts[k] for k in BREAKDOWN}, name))
    phases[f"{PIPELINE}_step"] = llm.step_seconds
    memory = input_memory(item, recompute)
    stages = llm.per_stage
    if item.colocated:  # both modules' state and the input's activations; the larger temporary
        held = memory["peak"] - memory["temporary"]
        stages = tuple(replace(s, inputs=held, peak=s.peak - s.temporary + held + max(s.temporary, memory["temporary"]))
                       for s in stages)
    peak = max([s.peak for s in stages] + ([] if item.colocated else [memory["peak"]]))
    return replace(llm, step_seconds=step, breakdown=breakdown, per_stage=stages, peak_bytes=peak,
                   events=llm.events if record_events else (), phases=phases, chunks=c, critical_module=critical,
                   input_memory={name: memory})
