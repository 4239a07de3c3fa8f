"""`dynaplane calibrate`: measure this machine as a device profile for `--profile`.

This is the CPU calibration (`--device cpu`, the default); `--device cuda` measures GPUs
instead (calibrate_device.py).

All `ranks` processes measure at the same time, as a training run's ranks would share
the machine: each process's numbers are what one rank gets (on a CPU with fewer cores
than ranks they share the cores). Measured, per rank:
- bf16 / fp32 matmul rate (the fastest of a few GEMM shapes, each as a linear layer's
  forward and two backward GEMMs run it) and how it falls off for a short inner
  dimension (matmul_k_half);
- scaled-dot-product attention rate against the bf16 matmul rate (attention_fraction);
- memory-bound throughput by op (out-of-place elementwise ops on tensors larger than the
  caches, allocation included, as eager PyTorch runs them); their median for other ops;
- per-op host cost in the real program: steps of the training program itself (tiny-gpt,
  ParallelTrainer: plain data parallelism, tensor parallelism and ZeRO-3), every rank of
  the world at once, each in its own process over torch's fake process group on real
  tensors, so every kernel, hook and DTensor dispatch runs and no collective takes time
  (its noise on a shared CPU would decide the solve otherwise); the emulator predicts the
  same steps with free collectives, and the per-aten-op (launch_seconds), per-DTensor-op
  (dispatch_seconds) and per-side-stream-collective host costs are the non-negative values
  that best make the predictions meet the measured times. A pipeline cannot run over a
  fake group: its steps (pp=2) are timed over a real gloo group, and the per-p2p host cost
  is what makes the emulator's full prediction of them (collectives and transfers at their
  measured costs) meet them (solved_host_cost). Likewise a tp=2 step over a real group
  decides what the ranks' rendezvous at each of tensor parallelism's collectives costs
  beyond its measured time alone (rendezvous_seconds). On a CPU this host work (Python,
  module hooks, the autograd engine, the optimizer's loop, DTensor's sharding
  propagation) runs in series with the kernels; a small transformer-like block's forward
  + backward divided by its aten ops gives a first estimate, used where the program's
  steps cannot decide;
- gloo all-reduce time between the ranks at several sizes, fitted to the ring model
  2(n-1) alpha + 2(n-1)/n S / B (intra_node_latency from small sizes, intra_node_bandwidth
  from large ones), for groups of other sizes;
- for the ranks' own group size, a table of all-reduce, all-gather and reduce-scatter
  times from 4 KiB to 16 MiB and at every size the traced layouts use (calibrate_ops.
  collective_sizes), each issued between matmuls as a training step issues them
  (the time of matmul + collective minus the matmul's alone): on a CPU a small
  collective costs the wake-up of a process that slept waiting for its peer, about twice
  what back-to-back collectives show;
- nothing of the program's data-parallel communication hides behind compute
  (comm_streams False): without device streams FSDP2's all-gathers and reduce-scatters
  run with async_op=False on the thread that computes, and ZeRO's gradient all-reduce is a
  blocking call (docs/benchmarks-history.md, session 8: a ZeRO-3 step took its compute plus all
  its collectives in series, where an overlap measured with an asynchronous all-reduce
  beside matmuls had the simulator hide 12-24% of them).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from parallelism.emulator.calibrate_ops import (SIZE_LADDER, CacheFlush, attention_rate, last_level_cache_bytes,
                                                matmul_rates, measure_attentions, measure_gemms, measure_op_bandwidths,
                                                collective_call, merge_tables, op_cases)
from parallelism.emulator.devices import DeviceProfile
from parallelism.emulator.profile_merge import median_measurement

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Effort:
    """How hard calibrate measures. `QUICK` gives a rough profile in a fraction of the time
    (one GEMM shape, fewer repeats and sizes): enough for a first look, or to check the
    tool works; the full effort is what the validation in docs/benchmarks.md uses."""
    # Nine timed runs per op and nine samples per collective, in three passes (calibrate_rank):
    # with three and five in one pass, two calibrations of the same machine minutes apart
    # put a tp=2 llama-124m step 0.5 s apart (its 344 small all-reduces read 1.3-2.7 ms;
    # docs/benchmarks-history.md, session 8).
    passes: int = 3
    repeats: int = 3
    gemm_shapes: tuple = ((512, 768, 768), (512, 2048, 768), (512, 768, 2048), (1024, 1024, 1024))
    bandwidth_tensors: int = 16
    table_sizes: tuple = tuple(1 << e for e in range(12, 25, 2))  # 4 KiB ... 16 MiB
    table_repeats: int = 3
    program_steps: int = 8
    op_sizes: tuple = SIZE_LADDER  # elements per tensor of the memory-bound ops' size ladder
    # Launches of fresh rank processes that time each real-group program step (its median
    # launch decides the host cost): the tiny-gpt tp=2 step over gloo is half waiting at its
    # 76 collectives, and one launch's median step read 211-263 ms between calibrations
    # (rendezvous_seconds 0.46 against 0.99 ms, llama-124m's tp=2 step 0.79 against 0.88 s),
    # 217-244 ms in five launches back to back (session 26).
    real_group_launches: int = 5


FULL = Effort()
QUICK = Effort(passes=1, repeats=1, gemm_shapes=((512, 768, 768),), bandwidth_tensors=4,
               table_sizes=(1 << 12, 1 << 18, 1 << 22), table_repeats=2, program_steps=5,
               op_sizes=(1 << 12, 1 << 20), real_group_launches=1)


def _op_overhead() -> float:
    """Seconds per aten op of a tiny block's forward + backward (Python, dispatcher, autograd)."""
    from parallelism.emulator.recorder import OpRecorder

    block = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 16))
    x = torch.randn(2, 4, 16)

    def step() -> None:
        block(x).sum().backward()

    recorder = OpRecorder()
    with recorder:
        step()
    ops = len(recorder.records)
    step()
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(20):
            step()
        samples.append((time.perf_counter() - started) / 20)
    return statistics.median(samples) / max(ops, 1)


def _dispatch_overhead(world: int, n: int = 200) -> float:
    """Seconds DTensor adds to an op on top of the local op it runs: small replicated
    DTensors (no communication) against the same ops on plain tensors, with the ops a
    tensor-parallel block runs (matmul, add, transpose, a view), forward only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (world,))
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    dx, dw = (DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (x, w))

    def ops(a, b) -> None:
        for _ in range(n):
            c = a @ b + a
            c.view(-1), c.t()

    ops(x, w)
    ops(dx, dw)
    plain = min(_elapsed(lambda: ops(x, w)) for _ in range(3))
    sharded = min(_elapsed(lambda: ops(dx, dw)) for _ in range(3))
    return max(sharded - plain, 0.0) / (4 * n)


def _elapsed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _allreduce_fit(world: int) -> tuple[float, float]:
    """(latency per hop, bytes/s) of the ring model 2(n-1) alpha + 2(n-1)/n S / B: alpha from
    the small sizes (<= 256 KiB, where latency is all there is: on a busy CPU it is the
    scheduler's wake-up, not the wire), B from the large ones net of that latency. Each
    point is the median of 8 all-reduces issued back to back, as training issues them."""
    if world < 2:
        return 1e-6, 10e9
    hops = 2 * (world - 1)
    measured = {}
    for size in (1 << 12, 1 << 16, 1 << 18, 1 << 22, 1 << 24):
        t = torch.ones(size // 4)
        dist.barrier()
        samples = []
        for _ in range(9):
            started = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - started)
        measured[size] = statistics.median(samples[1:])
    alpha = max(statistics.median(v for s, v in measured.items() if s <= 1 << 18) / hops, 1e-7)
    # On a loaded machine the small sizes can take as long as the large ones: the latency
    # then explains at most half of a large all-reduce, never all of it.
    bandwidth = statistics.median(hops / world * s / max(v - hops * alpha, v / 2)
                                  for s, v in measured.items() if s >= 1 << 22)
    return alpha, bandwidth


def _table_sizes(ladder: tuple, extra: list[float]) -> list[float]:
    """The ladder and the trace's own sizes, ascending, each once."""
    return sorted({float(s) for s in ladder} | {float(s) for s in extra})


def _collective_table(world: int, sizes: tuple, repeats: int = 5, per_sample: int = 8,
                      extra: dict[str, list[float]] | None = None) -> dict:
    """{kind: [[bytes, seconds], ...]} measured in program context (see the module doc) at the
    ladder's `sizes` and, per kind, at the `extra` sizes (the traces' own collectives). The
    matmul in between is fp32: on a CPU without native bf16 a bf16 one takes 100+ ms.
    Each point is the median of `repeats` samples, as every timing here is
    (calibrate_ops.typical_seconds says why). The small ones are samples of `per_sample`
    back to back: their cost is the wake-up of a rank that slept waiting for its peer, a
    part of every such collective. Those above 16 MiB are one collective per sample (a
    500 MB all-reduce takes ~0.3 s on two CPU ranks), alone (a matmul before it changes
    nothing), each point's samples one after the other into its one reused output, as a
    program's step after step. Sampled in rounds over all the big points instead (session
    9, when every call wrote a fresh output), a 249 MB all-gather read 1.0 s where the
    real ZeRO-1 step's took 0.40-0.47 s and back-to-back samples 0.43 s, in the same
    processes minutes apart (docs/benchmarks-history.md, session 11); the calibration's passes
    put a point's samples minutes apart instead."""
    a, b = torch.randn(128, 768), torch.randn(768, 768)
    extra = extra or {}

    def timed(fn) -> float:
        fn()
        dist.barrier()
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(per_sample):
                fn()
            samples.append((time.perf_counter() - started) / per_sample)
        return statistics.median(samples)

    def one_at_a_time(fn) -> float:
        fn()  # warm-up: the buffers' first touch
        samples = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    table: dict = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        table[kind] = []
        for size in _table_sizes(sizes, extra.get(kind, [])):
            collective = collective_call(kind, size, world)
            if size > 1 << 24:
                seconds = one_at_a_time(collective)
            else:
                def both() -> None:
                    a @ b
                    collective()

                seconds = max(timed(collective), timed(both) - timed(lambda: a @ b))
            table[kind].append([float(size), seconds])
            del collective
    return table


PROGRAM_MODEL, PROGRAM_MICRO_BATCHES, PROGRAM_SEQ = "tiny-gpt", 4, 64


def program_layouts(world: int) -> list[str]:
    """The layouts whose real steps decide the host costs: plain data parallelism, (tiny-gpt
    has 2 kv heads) tensor parallelism of 2 when the ranks pair up, and ZeRO-3 (FSDP2's
    host work around its collectives) when there is more than one rank."""
    layouts = [f"tp=1,pp=1,dp={world},zero=1"]
    if world % 2 == 0:
        layouts.append(f"tp=2,pp=1,dp={world // 2},zero=1")
    if world >= 2:
        layouts.append(f"tp=1,pp=1,dp={world},zero=3")
    if world % 2 == 0:
        layouts.append(f"tp=1,pp=2,dp={world // 2},zero=1")
    return layouts


def _program_batch(layout: str, world: int) -> int:
    dp = world // (2 if layout.startswith("tp=2") or "pp=2" in layout else 1)
    return PROGRAM_MICRO_BATCHES * dp


def _program_step(layout: str, rank: int, world: int, measured: int = 5) -> float:
    from parallelism.emulator.real_steps import time_steps

    # The median step, as calibrate's op timings are medians: both describe the machine as
    # a step meets it, other processes included.
    return time_steps(PROGRAM_MODEL, layout, rank, _program_batch(layout, world), 1, PROGRAM_SEQ,
                      warmup=2, measured=measured).seconds


def commless_program_step(layout: str, world: int, rank: int = 0, measured: int = 5) -> float:
    """The median step of the program model's `rank` for `layout` in a world of `world`
    ranks joined over torch's fake process group, on real tensors: every kernel, hook and
    DTensor dispatch runs for real and every collective returns at once. Run in a fresh
    process (tracer.in_fresh_processes), one per rank at the same time, so that the ranks
    share the cores as a real run's do. What it measures is the host work and kernels of
    the program without the collectives' time, whose noise on a shared CPU (a small gloo
    all-reduce took 1.4-3.8 ms from one calibration to the next) otherwise decides the
    host costs solved from the step."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        return _program_step(layout, rank, world, measured)
    finally:
        dist.destroy_process_group()


def real_program_step(rank: int, world: int, layout: str, measured: int = 5) -> float:
    """The median step of the program model's `rank` for `layout` over a real (gloo) group,
    as launch.run_ranks' fn. For a pipeline: its schedule exchanges tensor shapes over the
    group at its first step, which a fake group cannot carry, and its sends and receives
    wait on each other, which is what its host cost per p2p op has to explain."""
    torch.set_num_threads(1)
    return _program_step(layout, rank, world, measured)


# The costs only a step over a real group shows, and the program model's layout that shows
# each: a pipeline's per-p2p host cost (a fake group cannot carry its exchange of tensor
# shapes) and the ranks' rendezvous at tensor parallelism's collectives (over a fake group no
# rank waits for another).
REAL_GROUP_COSTS = (("tp=1,pp=2,dp={half},zero=1", "p2p_host_seconds"),
                    ("tp=2,pp=1,dp={half},zero=1", "rendezvous_seconds"))


def real_group_layouts(world: int) -> list[tuple[str, str]]:
    """[(layout, the host cost its real-group step decides)] for `world` ranks (pairs)."""
    return [(layout.format(half=world // 2), cost) for layout, cost in REAL_GROUP_COSTS] if world % 2 == 0 else []


def solved_host_cost(cost: str, trace, profile: DeviceProfile, world: int, measured: float,
                     ceiling: float = 1.0) -> float | None:
    """The value of the profile's `cost` (p2p_host_seconds, rendezvous_seconds) that makes
    the emulator's prediction of a step over a real group (its collectives and transfers at
    the profile's measured costs) equal `measured` seconds. The predicted step never shrinks
    as the cost grows, so bisection. 0 where the step is predicted no faster than measured
    already; None where no cost up to `ceiling` explains it (the trace has no op that
    carries it, or the step is slow for another reason)."""
    from parallelism.emulator.simulate import simulate

    def predicted(seconds: float) -> float:
        return simulate(trace, dataclasses.replace(profile, **{cost: seconds}), world).step_seconds

    if predicted(0.0) >= measured:
        return 0.0
    if predicted(ceiling) < measured:
        return None
    low, high = 0.0, ceiling
    while high - low > 1e-7:
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle) < measured else (low, middle)
    return high


def without_comm(profile: DeviceProfile) -> DeviceProfile:
    """`profile` with every collective free: what a fake process group gives."""
    return dataclasses.replace(profile, collective_table={}, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30,
                               intra_node_latency=0.0, inter_node_latency=0.0, rendezvous_seconds=0.0)


def commless_seconds(trace, profile: DeviceProfile, world: int) -> float:
    """The emulator's prediction of commless_program_step: rank 0's busy time with free
    collectives (no bubble: over a fake group no rank waits for another)."""
    from parallelism.emulator.simulate import simulate

    breakdown = simulate(trace, without_comm(profile), world).per_stage[0].breakdown
    return sum(seconds for part, seconds in breakdown.items() if part != "bubble")


HOST_COSTS = ("launch_seconds", "dispatch_seconds", "collective_host_seconds", "p2p_host_seconds")


def nonnegative_lstsq(a, b):
    """argmin ||a x - b|| over x >= 0, by trying every set of variables held at zero: the
    solve has at most four unknowns (numpy has no NNLS and this is the only use of one,
    so not a scipy dependency for it). None when no such x has a positive first entry."""
    import itertools

    import numpy as np

    n = a.shape[1]
    best, best_residual = None, float("inf")
    for k in range(n, 0, -1):
        for kept in itertools.combinations(range(n), k):
            if 0 not in kept:
                continue  # the per-op cost is always there
            x = np.zeros(n)
            x[list(kept)] = np.linalg.lstsq(a[:, kept], b, rcond=None)[0]
            residual = float(np.linalg.norm(a @ x - b))
            if (x >= 0).all() and x[0] > 0 and residual < best_residual - 1e-15:
                best, best_residual = x, residual
    return best


def program_host_costs(profile: DeviceProfile, world: int, measured: dict[str, float]) -> tuple[float, ...]:
    """The HOST_COSTS (per aten op, per DTensor op, per side-stream collective, per p2p op)
    that make the emulator's predictions of the program steps equal their measured times,
    starting from `profile`'s estimates: the predicted step is (nearly) linear in them, so
    Newton steps on finite differences solve it. Each layout decides one more cost: plain
    data parallelism the per-op cost, tensor parallelism the DTensor one, ZeRO-3 the
    per-collective one, a pipeline the per-p2p one; costs the measured layouts cannot decide
    keep their estimates. The costs cannot be negative: where the exact solution would
    need one (noise in a step), the least-squares solution with that cost at zero is
    taken (nonnegative_lstsq); where no positive per-op cost explains the steps, the
    estimates stay."""
    import numpy as np

    from parallelism.emulator.tracer import TraceRequest, trace

    layouts = list(measured)
    traces = {layout: trace(TraceRequest(PROGRAM_MODEL, layout, 1, PROGRAM_SEQ, PROGRAM_MICRO_BATCHES, world))[0]
              for layout in layouts}
    estimate = np.array([getattr(profile, name) for name in HOST_COSTS])
    # which costs the layouts can decide: the per-op cost always, the others where a layout exercises them
    free = [0] + [i for i, test in ((1, "tp=2"), (2, "zero=3"), (3, "pp=2")) if any(test in layout for layout in layouts)]
    free = free[:len(layouts)]

    def predicted(costs: np.ndarray) -> np.ndarray:
        p = dataclasses.replace(profile, **dict(zip(HOST_COSTS, map(float, costs))))
        return np.array([commless_seconds(traces[layout], p, world) for layout in layouts])

    costs, real = estimate.copy(), np.array([measured[layout] for layout in layouts])
    for _ in range(2):  # the prediction is nearly linear in the costs: a second pass absorbs the rest
        base = predicted(costs)
        step = 1e-6
        jacobian = np.stack([(predicted(costs + step * np.eye(len(HOST_COSTS))[i]) - base) / step for i in free],
                            axis=1)
        if np.linalg.matrix_rank(jacobian) < len(free):
            return tuple(float(c) for c in estimate)
        solved = nonnegative_lstsq(jacobian, real - base + jacobian @ costs[free])
        if solved is None:  # no positive per-op cost explains the steps
            return tuple(float(c) for c in estimate)
        costs[free] = solved
    return tuple(float(c) for c in costs)


def calibrate_rank(rank: int, world: int, effort: Effort = FULL, shapes: dict | None = None,
                   collectives: dict | None = None) -> dict:
    """This rank's measurements: `effort.passes` passes over everything, each point the
    median over the passes. `shapes`: calibrate_ops.shapes_by_residency's GEMM and
    attention shapes; `collectives`: calibrate_ops.collective_sizes.

    Passes, not more repeats in one go: on a shared host the machine's speed wanders in
    spells of seconds to minutes (one layout's real step moved 15% between two rounds
    minutes apart), so a quantity timed in one burst carries whatever spell it fell in, and
    every GEMM timed in the same fast spell errs the same way. Three passes over the whole
    calibration put each quantity's samples a minute apart."""
    import sys

    torch.manual_seed(rank)
    started = time.perf_counter()

    def phase(name: str) -> None:  # rank 0 says how far it is: a full calibration takes minutes
        if rank == 0:
            print(f"  calibrate: {name} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    passes = []
    for n in range(effort.passes):
        passes.append(_measure_pass(world, effort, shapes or {}, collectives,
                                    lambda name: phase(f"pass {n + 1}/{effort.passes}: {name}")))
    out = median_of_passes(passes)
    out["ops"] = {name: points[-1][1] for name, points in out["ops_table"].items()}  # the largest size: DRAM
    out["memory"] = statistics.median(out["ops"].values())  # ops the profile has no rate for run at the typical one
    phase("done on the ranks")
    return out


def median_of_passes(passes: list[dict]) -> dict:
    """Each measurement's median over the passes: numbers, and the rate (last column) of
    every row of the tables."""
    return {key: median_measurement([p[key] for p in passes], key) for key in passes[0]}


def _measure_pass(world: int, effort: Effort, shapes: dict, collectives: dict | None, phase) -> dict:
    """One pass of calibrate_rank's measurements, `effort.repeats` runs per op."""
    dist.barrier()
    r = effort.repeats
    out: dict = {}
    phase("matmul rates")
    bf16 = max((matmul_rates(m, n, k, torch.bfloat16, r) for m, n, k in effort.gemm_shapes), key=lambda rates: rates[0])
    out["bf16"], out["bf16_forward"] = bf16
    out["fp32"] = max(matmul_rates(m, n, k, torch.float32, r)[0]
                      for m, n, k in {effort.gemm_shapes[0], effort.gemm_shapes[-1]})
    out["short_k"] = matmul_rates(512, 768, 32, torch.bfloat16, r)[1]  # inner dimension 32 in the forward GEMM
    dist.barrier()
    cold, hot = shapes.get("cold", ((), ())), shapes.get("hot", ((), ()))
    phase(f"the traces' {len(cold[0]) + len(hot[0])} GEMM and {len(cold[1]) + len(hot[1])} attention shapes "
          f"({len(cold[0]) + len(cold[1])} from memory)")
    out["gemm_table"] = merge_tables(measure_gemms(cold[0], r, dist.barrier, 2 * last_level_cache_bytes()),
                                     measure_gemms(hot[0], r, dist.barrier))
    out["attention_table"] = merge_tables(measure_attentions(cold[1], r, dist.barrier, 2 * last_level_cache_bytes()),
                                          measure_attentions(hot[1], r, dist.barrier))
    dist.barrier()
    phase("attention and memory-bound ops")
    out["attention"] = attention_rate(r)
    flush = CacheFlush()
    out["ops_table"] = measure_op_bandwidths(op_cases, effort.bandwidth_tensors, r, effort.op_sizes, dist.barrier,
                                             flush=flush)
    del flush
    phase("per-op overheads")
    out["overhead"] = _op_overhead()
    out["dispatch"] = _dispatch_overhead(world)
    dist.barrier()
    phase("collectives")
    out["alpha"], out["bandwidth"] = _allreduce_fit(world)
    out["table"] = (_collective_table(world, effort.table_sizes, effort.table_repeats, extra=collectives)
                    if world >= 2 else {})
    return out


def nondecreasing(values: list[float]) -> list[float]:
    """The largest non-decreasing curve under the measured times: each point's suffix
    minimum. A collective cannot take less time for more bytes, and on a shared machine
    noise only ever adds time, so every measurement is an upper bound on the true time at
    its size and on the true time at every smaller size; the tightest such bound is the
    minimum over this size and all larger ones. E.g. [2.4, 0.2, 8.4, 0.3, 0.5] ->
    [0.2, 0.2, 0.3, 0.3, 0.5]."""
    out, low = [], float("inf")
    for v in reversed(values):
        low = min(low, v)
        out.append(low)
    return out[::-1]


def shape_traces(world: int, requests: list, progress=None) -> list:
    """Traces whose GEMM and attention shapes calibrate measures: the program model's
    layouts (their steps decide the host costs) and any the user asks for."""
    from parallelism.emulator.tracer import TraceRequest, trace

    wanted = [TraceRequest(PROGRAM_MODEL, layout, 1, PROGRAM_SEQ, PROGRAM_MICRO_BATCHES, world)
              for layout in program_layouts(world)] + list(requests)
    out = []
    for n, request in enumerate(wanted):
        if progress:
            progress(f"tracing {request.model} {request.layout} for its op shapes ({n + 1}/{len(wanted)})")
        out.append(trace(request)[0])
    return out


def calibrate(ranks: int = 2, effort: Effort = FULL, shapes_from: list = ()) -> DeviceProfile:
    """Measure this machine with `ranks` ranks at once. `shapes_from`: TraceRequests whose
    GEMMs and attentions are timed at their own shapes (the program model's always are)."""
    import sys

    from parallelism.emulator.calibrate_ops import collective_sizes, last_level_cache_bytes, shapes_by_residency
    from parallelism.engine.launch import run_ranks

    def say(text: str) -> None:
        print(f"  calibrate: {text}", file=sys.stderr, flush=True)

    traces = shape_traces(ranks, list(shapes_from), say)
    shapes, collectives = shapes_by_residency(traces, last_level_cache_bytes()), collective_sizes(traces, ranks)
    results = run_ranks(ranks, calibrate_rank, effort, shapes, collectives, timeout_s=1200)  # minutes on a small CPU machine

    def median(key: str) -> float:
        return statistics.median(r[key] for r in results)

    bf16 = median("bf16")
    from parallelism.emulator.tracer import TraceRequest, in_fresh_processes, trace

    say("timing the program's steps over a fake process group (real kernels and hooks, no communication)")
    # Not the pipeline: torch.distributed.pipelining exchanges tensor shapes over the group at
    # its first step, which a fake group cannot carry (its steps are timed over a real group
    # below, and decide p2p_host_seconds alone).
    layouts = [layout for layout in program_layouts(ranks) if "pp=1" in layout]
    steps = in_fresh_processes({(layout, rank): (commless_program_step, (layout, ranks, rank, effort.program_steps))
                                for layout in layouts for rank in range(ranks)}, say, "program step")
    program = {layout: max(steps[(layout, rank)] for rank in range(ranks)) for layout in layouts}
    # eff(k) = k / (k + k_half), from the forward GEMM at k = 32 against the same form at full k
    k_half = max(1.0, 32 * (median("bf16_forward") / max(median("short_k"), 1.0) - 1))
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    estimated = DeviceProfile(
        name="cpu-calibrated", peak_flops={"bf16": bf16, "fp32": median("fp32")}, hbm_bytes=memory_bytes // ranks,
        hbm_bandwidth=median("memory"), sm_count=0, matmul_max_fraction=1.0,
        attention_fraction=min(1.0, median("attention") / bf16), memory_fraction=1.0,
        launch_seconds=median("overhead"), dispatch_seconds=median("dispatch"), comm_overlap=0.0, comm_streams=False, intra_node_bandwidth=median("bandwidth"), intra_node_efficiency=1.0,
        intra_node_latency=median("alpha"), inter_node_bandwidth=median("bandwidth"), inter_node_efficiency=1.0,
        inter_node_latency=median("alpha"), matmul_k_half=k_half, gpus_per_node=ranks,
        op_bandwidth={name: statistics.median(r["ops"][name] for r in results) for name in results[0]["ops"]},
        op_bandwidth_table=median_measurement([r["ops_table"] for r in results], "ops_table"),
        matmul_table=median_measurement([r["gemm_table"] for r in results], "gemm_table"),
        attention_table=median_measurement([r["attention_table"] for r in results], "attention_table"),
        # A collective ends on every rank together: its cost is the slowest rank's.
        collective_table={kind: {str(ranks): [[size, seconds] for (size, _), seconds in zip(points, nondecreasing(
            [max(r["table"][kind][i][1] for r in results) for i in range(len(points))]))]}
                          for kind, points in results[0]["table"].items()},
        notes=f"measured by dynaplane calibrate with {ranks} ranks on {os.cpu_count()} CPUs")
    say("predicting the program steps (traces tiny-gpt)")
    host = dict(zip(HOST_COSTS, program_host_costs(estimated, ranks, program)))
    for layout, cost in real_group_layouts(ranks):
        say(f"timing the program's {layout} steps over a real group (for {cost})")
        seconds = statistics.median(max(run_ranks(ranks, real_program_step, layout, effort.program_steps,
                                                  timeout_s=600)) for _ in range(effort.real_group_launches))
        program[f"{layout} over gloo"] = seconds
        steps_of = trace(TraceRequest(PROGRAM_MODEL, layout, 1, PROGRAM_SEQ, PROGRAM_MICRO_BATCHES, ranks))[0]
        solved = solved_host_cost(cost, steps_of, dataclasses.replace(estimated, **host), ranks, seconds)
        if solved is not None:
            host[cost] = solved
    steps = ", ".join(f"{layout}: {seconds * 1e3:.1f} ms" for layout, seconds in program.items())
    return dataclasses.replace(
        estimated, **host,
        notes=f"{estimated.notes}; host costs from {PROGRAM_MODEL} steps ({steps}); a small block's estimate "
              f"was {estimated.launch_seconds * 1e6:.1f} us per op, +{estimated.dispatch_seconds * 1e6:.1f} us per DTensor op")
