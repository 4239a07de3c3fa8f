"""Simulate one step of a heterogeneous layout (pure: no torch).

The LLM's pipeline is simulate.py's; the encoder is one unpipelined rank class whose
traced step (forward over its whole share, backward, gradient reduction, optimizer) is
timed by the same device and network models; the boundary's exchanges take, on each traced
rank, max(its sends, its recvs), and the slowest rank's.

- **colocated** (encoder and LLM on the same GPUs, as HeteroTrainer runs it): encoder
  forward for the batch, boundary forward, the LLM's step, boundary backward, encoder
  backward, encoder gradient reduction and optimizer, one after the other on every rank:
  the step is their sum. Memory: both modules' state plus the encoder's activations of the
  whole share (held while the LLM runs) on every rank, over the LLM's per-stage peak.
- **non-colocated** (encoder on its own ranks): the encoder streams its share in `chunks`
  pieces (one per LLM micro-batch when the batch divides, else fewer): chunk i's forward
  ends at (i+1) F/c, its image tokens reach the LLM's first stage bf/c later and feed the
  micro-batches that hold those samples (simulate's `input_ready`); chunk i's backward runs
  when the first stage's backward of its last micro-batch plus bb/c has arrived, after
  all encoder forwards. The step is the critical path of the two: max(LLM step, encoder
  end). Memory per module on its own ranks. `chunks=1` is what HeteroTrainer runs today
  (whole batch, then the LLM, then the encoder backward).
Per-chunk time is 1/c of the whole-share trace (the kernels' efficiency at 1/c of the rows
is not re-evaluated).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from agents.emulator.costs import op_seconds
from agents.emulator.devices import DeviceProfile
from agents.emulator.errors import require
from agents.emulator.hetero_trace import HeteroTrace
from agents.emulator.simulate import BREAKDOWN, PARTS, RECOMPUTE, SimResult, stage_cost, simulate


@dataclass(frozen=True)
class HeteroSimResult:
    step_seconds: float
    colocated: bool
    chunks: int
    phases: dict[str, float]          # the encoder rank's step and the LLM's, seconds
    breakdown: dict[str, float]       # the critical module's busiest rank's, sums to step_seconds
    critical_module: str
    encoder_memory: dict[str, int]
    llm_memory: tuple[dict, ...]      # per LLM pipeline stage (colocated: encoder included)
    peak_bytes: int
    hbm_bytes: int
    llm: SimResult = field(repr=False)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm_bytes


def boundary_seconds(ranks, profile: DeviceProfile, gpus_per_node: int) -> float:
    """The exchange ends when the slowest traced rank's does; a rank sends and receives at once."""
    worst = 0.0
    for ops in ranks:
        sends = sum(op_seconds(op, profile, gpus_per_node) for op in ops if op.kind == "send")
        recvs = sum(op_seconds(op, profile, gpus_per_node) for op in ops if op.kind == "recv")
        worst = max(worst, sends, recvs)
    return worst


def encoder_chunks(samples: int, micro_batches: int, colocated: bool) -> int:
    """Pieces the non-colocated encoder streams its share in: the largest divisor of the
    LLM's micro-batch count that divides the share (1 when colocated)."""
    if colocated or samples == 0:
        return 1
    return max(c for c in range(1, micro_batches + 1) if micro_batches % c == 0 and samples % c == 0)


def simulate_hetero(trace: HeteroTrace, profile: DeviceProfile, gpus_per_node: int = 8, recompute: str = "none",
                    chunks: int | None = None) -> HeteroSimResult:
    require(isinstance(trace, HeteroTrace), f"trace must be a HeteroTrace, got {type(trace).__name__}")
    require(recompute in RECOMPUTE, f"recompute={recompute!r} not in {RECOMPUTE}")
    m = trace.llm.micro_batches
    c = chunks if chunks is not None else encoder_chunks(trace.encoder_samples, m, trace.colocated)
    require(isinstance(c, int) and c >= 1 and m % c == 0, f"chunks={c!r} must be a positive divisor of {m} micro-batches")
    require(c == 1 or not trace.colocated, "a colocated encoder runs its share in one piece (chunks=1)")
    enc = stage_cost(trace.encoder, profile, gpus_per_node, recompute)
    bf = boundary_seconds(trace.boundary_forward, profile, gpus_per_node)
    bb = boundary_seconds(trace.boundary_backward, profile, gpus_per_node)
    sync = sum(s for s, _ in enc.grad_buckets)
    optimizer = sum(enc.optimizer.values()) + sum(s for s, _ in enc.step_syncs)
    phases = {"encoder_forward": enc.forward.seconds, "boundary_forward": bf, "encoder_backward": enc.backward.seconds,
              "boundary_backward": bb, "encoder_grad_sync": sync, "encoder_optimizer": optimizer}
    enc_parts = dict.fromkeys(PARTS, 0.0)
    for part in (enc.forward.parts, enc.backward.parts, enc.optimizer):
        for key, value in part.items():
            enc_parts[key] += value
    enc_parts["dp_comm"] += sync + sum(s for s, cat in enc.step_syncs if cat == "dp_comm")
    enc_parts["pp_comm"] += bf + bb  # the boundary's transfers

    if trace.colocated:
        llm = simulate(trace.llm, profile, gpus_per_node, recompute)
        step = llm.step_seconds + sum(phases.values())
        breakdown = {k: llm.breakdown[k] + enc_parts.get(k, 0.0) for k in BREAKDOWN}
        critical = "llm+encoder"
    else:
        f, b = enc.forward.seconds / c, enc.backward.seconds / c
        ready = [(j * c // m + 1) * f + bf / c for j in range(m)]
        llm = simulate(trace.llm, profile, gpus_per_node, recompute, record_events=True, input_ready=tuple(ready))
        first_b = {e.micro_batch: e.end for e in llm.events if e.kind == "backward" and e.stage == 0}
        t = c * f
        for i in range(c):
            grads_back = max(first_b[j] for j in range(m) if j * c // m == i) + bb / c
            t = max(t, grads_back) + b
        encoder_end = t + sync + optimizer
        step = max(llm.step_seconds, encoder_end)
        phases["llm_step"] = llm.step_seconds
        phases["encoder_end"] = encoder_end
        llm_parts = dict(llm.breakdown)
        llm_parts["bubble"] += step - llm.step_seconds
        enc_parts["bubble"] = max(0.0, step - sum(enc_parts.values()))
        # the module on the critical path: the one that ends the step
        breakdown, critical = ((llm_parts, "llm") if llm.step_seconds >= encoder_end
                               else ({k: enc_parts[k] for k in BREAKDOWN}, "encoder"))
    phases["llm_step"] = llm.step_seconds
    mem = trace.encoder.memory
    encoder_memory = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
                      "activations": mem.activations(recompute), "temporary": mem.temporary}
    encoder_memory["peak"] = sum(encoder_memory.values())
    stages = []
    for s in llm.per_stage:
        row = {"stage": s.stage, "params": s.params, "grads": s.grads, "optimizer": s.optimizer,
               "activations": s.activations, "temporary": s.temporary, "peak": s.peak}
        if trace.colocated:  # both modules' state and the encoder's activations; the larger temporary
            row["encoder"] = encoder_memory["peak"] - encoder_memory["temporary"]
            row["peak"] = s.peak - s.temporary + row["encoder"] + max(s.temporary, encoder_memory["temporary"])
        stages.append(row)
    peak = max([r["peak"] for r in stages] + ([] if trace.colocated else [encoder_memory["peak"]]))
    return HeteroSimResult(step, trace.colocated, c, phases, breakdown, critical, encoder_memory, tuple(stages),
                           peak, profile.hbm_bytes, llm)
