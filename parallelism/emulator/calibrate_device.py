"""`dynaplane calibrate --device cuda`: measure this machine's GPUs as a device profile.

One rank process per GPU (`--ranks N`, rank r on cuda:r, NCCL between them), all measuring
at once. Every op runs on the device and is timed by CUDA events (calibrate_ops.Clock);
where calibrate_ops reads past the CPU's last-level cache (operand pools, a flush), it
reads past twice the GPU's L2 (`L2_cache_size`) instead. Measured, per rank:
- bf16 / fp32 GEMM rates at a few large shapes (the best against the part's spec peak is
  matmul_max_fraction) and the fall-off at a short inner dimension (matmul_k_half);
- the traced steps' GEMMs and fused attentions (SDPA, flash or memory-efficient as torch
  picks) at their own shapes (calibrate_ops.measure_gemms / measure_attentions);
- memory-bound ops by size (calibrate_ops.measure_op_bandwidths) up to tensors far larger
  than the L2;
- the device-side cost of one small kernel in a stream of them (launch_seconds), timed
  while the host runs ahead (kernel_gap_seconds);
- with two or more ranks: all-reduce, all-gather and reduce-scatter over the ranks from
  4 KiB to 1 GiB (nccl-tests style: back-to-back calls on the device timed together, the
  slowest rank's) and at the traces' own sizes, into collective_table, and the ring
  model's latency and bandwidth fitted to the all-reduces (ring_fit). With one GPU no
  collective is measured: the network numbers stay the built-in profile's.

Not measured on a GPU, unlike on a CPU (calibrate.py): the per-op host costs. There the
host enqueues kernels ahead of the device, so Python, hooks and DTensor dispatch overlap
the kernels instead of adding to them (the built-in GPU profiles' convention: 0); the CPU
calibration's solve for them from tiny-gpt steps over a fake process group runs on CPU
tensors only (a fake group carries no device streams), so it is skipped here and
dispatch_seconds, collective_host_seconds, p2p_host_seconds and rendezvous_seconds are 0.

The same functions run with device "cpu" over gloo (tests, and the rehearsal of
benchmarks/emulator_gpu_check.py): real timings of the same code path on CPU tensors.
"""
from __future__ import annotations

import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from parallelism.emulator.calibrate import nondecreasing
from parallelism.emulator.calibrate_ops import (TABLE_KINDS, CacheFlush, Clock, attention_rate, collective_call,
                                                collective_sizes, last_level_cache_bytes, matmul_rates,
                                                measure_attentions, measure_gemms, measure_op_bandwidths,
                                                merge_tables, op_cases, shapes_by_residency)
from parallelism.emulator.devices import DeviceProfile, get_profile
from parallelism.emulator.profile_merge import median_measurement

GiB = 2**30
SPEC_PARTS = ("h200", "h100", "b200", "a100")  # built-in profiles a device name can match
NETWORK_FALLBACK = "h100"  # whose network numbers an unknown part with one GPU keeps


@dataclasses.dataclass(frozen=True)
class DeviceEffort:
    """Sizes and repeats of a device calibration. A GPU is not shared with other guests
    the way a host's cores are: one pass, each point the median of `repeats` runs."""
    repeats: int = 5
    gemm_shapes: tuple = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 8192))
    short_k: tuple = (8192, 8192, 256)   # (m, n, k): the forward GEMM at a short inner dimension
    attention_shape: tuple = (4, 16, 2048, 128)  # batch, heads, seq, head_dim
    bandwidth_tensors: int = 4
    op_sizes: tuple = (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 26)  # elements: 16 KiB .. 256 MiB of fp32
    table_sizes: tuple = tuple(1 << e for e in range(12, 31))  # 4 KiB ... 1 GiB, doubling (nccl-tests -b 4K -e 1G -f 2)
    table_iterations: int = 20  # back-to-back calls per timed sample (5 above 64 MiB)
    gap_kernels: int = 200


DEVICE = DeviceEffort()
QUICK_DEVICE = DeviceEffort(repeats=3, gemm_shapes=((8192, 8192, 8192),), op_sizes=(1 << 12, 1 << 20, 1 << 26),
                            table_sizes=tuple(1 << e for e in range(12, 31, 3)), table_iterations=10)


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What the device says of itself (device 0 of its kind; the ranks' GPUs are alike)."""
    kind: str          # "cuda" or "cpu"
    name: str          # e.g. "NVIDIA H200"
    memory_bytes: int  # per rank
    sm_count: int
    cache_bytes: int   # the cache a flush must exceed: the GPU's L2, a CPU's last-level cache
    count: int         # devices of the kind on this machine


def device_facts(kind: str, ranks: int = 1) -> DeviceFacts:
    if kind == "cuda":
        props = torch.cuda.get_device_properties(0)
        return DeviceFacts("cuda", props.name, int(props.total_memory), int(props.multi_processor_count),
                           int(props.L2_cache_size), torch.cuda.device_count())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceFacts("cpu", "cpu", memory // max(ranks, 1), 0, last_level_cache_bytes(), 1)


def kernel_gap_seconds(device, kernels: int = 200, busy=None) -> float:
    """Device seconds per small kernel in a stream of them: `kernels` one-element adds
    timed together, enqueued while `busy` (large GEMMs) still runs on a GPU, so that they
    run back to back on the device whatever the host's launch cost. On a CPU the wall time
    per add (no busy work)."""
    clock = Clock(device)
    x = torch.ones(1, device=device)
    if clock.cuda and busy is None:
        big = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)

        def busy() -> None:
            for _ in range(16):  # ~2 ms of GEMMs: longer than the host takes to enqueue the adds
                big @ big

    def adds() -> None:
        for _ in range(kernels):
            x.add_(1.0)

    samples = []
    for _ in range(3):
        if clock.cuda:
            busy()
        samples.append(clock.time(adds) / kernels)
    clock.synchronize()
    return statistics.median(samples)


def collective_table(world: int, sizes: tuple, iterations: int = 20, extra: dict | None = None,
                     device=None) -> dict:
    """{kind: [[bytes, seconds], ...]} for TABLE_KINDS at the ladder's `sizes` and the
    traces' own (`extra`), ascending: each the median of 3 samples of `iterations`
    back-to-back calls (5 above 64 MiB) timed together on the device after a warm-up,
    the ranks lined up by a barrier first (nccl-tests' method: its time is the slowest
    rank's, which calibrate takes over the ranks' tables)."""
    clock, extra = Clock(device), extra or {}
    table: dict = {}
    for kind in TABLE_KINDS:
        rows = []
        for size in sorted({float(s) for s in sizes} | {float(s) for s in extra.get(kind, [])}):
            call = collective_call(kind, size, world, device)
            n = iterations if size <= 1 << 26 else 5
            call()

            def many() -> None:
                for _ in range(n):
                    call()

            samples = []
            for _ in range(3):
                clock.synchronize()
                dist.barrier()
                clock.synchronize()
                samples.append(clock.time(many) / n)
            rows.append([size, statistics.median(samples)])
            del call
        table[kind] = rows
    return table


def ring_fit(points: list, world: int) -> tuple[float, float]:
    """(latency per hop, bytes/s) of the ring model 2(n-1) alpha + 2(n-1)/n S / B fitted to
    all-reduce [[bytes, seconds], ...]: alpha from the sizes up to 256 KiB (latency is all
    there is), B from the largest third of the sizes net of that latency (at most half of
    a large all-reduce is latency)."""
    hops = 2 * (world - 1)
    small = [s for b, s in points if b <= 1 << 18] or [points[0][1]]
    alpha = max(statistics.median(small) / hops, 1e-9)
    large = sorted(points)[-max(1, len(points) // 3):]
    bandwidth = statistics.median(hops / world * b / max(s - hops * alpha, s / 2) for b, s in large)
    return alpha, bandwidth


def measure_device_rank(rank: int, world: int, kind: str, effort: DeviceEffort, shapes: dict,
                        collectives: dict, cache_bytes: int) -> dict:
    """This rank's measurements on its device (cuda:<local rank>, which launch._entry made
    current; the CPU for kind "cpu"). Runs inside an initialized process group."""
    import sys

    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    torch.manual_seed(rank)
    clock = Clock(device)

    def sync() -> None:  # every rank times the same op at the same moment
        clock.synchronize()
        dist.barrier()

    def phase(name: str) -> None:
        if rank == 0:
            print(f"  calibrate ({device}): {name}", file=sys.stderr, flush=True)

    r, out = effort.repeats, {}
    phase("matmul rates")
    sync()
    out["bf16"], out["bf16_forward"] = max((matmul_rates(m, n, k, torch.bfloat16, r, device)
                                            for m, n, k in effort.gemm_shapes), key=lambda rates: rates[0])
    out["fp32"] = max(matmul_rates(m, n, k, torch.float32, r, device)[0] for m, n, k in effort.gemm_shapes[:1])
    m, n, k = effort.short_k
    out["short_k"], out["short_k_inner"] = matmul_rates(m, n, k, torch.bfloat16, r, device)[1], k
    cold, hot = shapes.get("cold", ((), ())), shapes.get("hot", ((), ()))
    phase(f"the traces' {len(cold[0]) + len(hot[0])} GEMM and {len(cold[1]) + len(hot[1])} attention shapes")
    out["gemm_table"] = merge_tables(measure_gemms(cold[0], r, sync, 2 * cache_bytes, device),
                                     measure_gemms(hot[0], r, sync, device=device))
    out["attention_table"] = merge_tables(measure_attentions(cold[1], r, sync, 2 * cache_bytes, device),
                                          measure_attentions(hot[1], r, sync, device=device))
    phase("attention and memory-bound ops")
    sync()
    out["attention"] = attention_rate(r, effort.attention_shape, device)
    flush = CacheFlush(cache_bytes, device)
    out["ops_table"] = measure_op_bandwidths(lambda elements, tensors: op_cases(elements, tensors, device),
                                             effort.bandwidth_tensors, r, effort.op_sizes, sync, device, flush)
    del flush
    out["gap"] = kernel_gap_seconds(device, effort.gap_kernels)
    if world >= 2:
        phase(f"collectives over {world} ranks")
        out["table"] = collective_table(world, effort.table_sizes, effort.table_iterations, collectives, device)
    else:
        out["table"] = {}
    if kind == "cuda":
        torch.cuda.empty_cache()
    phase("done on the ranks")
    return out


def spec_part(name: str) -> DeviceProfile | None:
    """The built-in profile of the part `name` is (h200, h100, b200, a100), else None."""
    lowered = name.lower()
    return next((get_profile(part) for part in SPEC_PARTS if part in lowered), None)


def _fraction(value: float) -> float:
    return min(1.0, max(value, 1e-6))


def device_profile(facts: DeviceFacts, results: list[dict], ranks: int) -> DeviceProfile:
    """The profile of the ranks' measurements (each number their median; a collective's
    time the slowest rank's) and the device's facts. Peak FLOP/s and HBM bandwidth are the
    spec figures of the matching built-in part, the measured rates their fractions; for an
    unknown part the measured best rates are the peaks."""
    def median(key: str) -> float:
        return statistics.median(r[key] for r in results)

    part = spec_part(facts.name)
    network = part or get_profile(NETWORK_FALLBACK)
    ops_table = median_measurement([r["ops_table"] for r in results], "ops_table")
    ops = {name: points[-1][1] for name, points in ops_table.items()}  # the largest size: from memory
    memory = statistics.median(ops.values())
    # rates the part's profile has from elsewhere (the A100's unfused-attention kernels) stay where not measured
    unmeasured = dict(part.op_bandwidth) if part else {}
    gemm_table = median_measurement([r["gemm_table"] for r in results], "gemm_table")
    # the best bf16 GEMM rate seen: the large shapes' or any traced shape's
    best_bf16 = max([median("bf16")] + [row[-1] for rows in gemm_table.get("bf16", {}).values() for row in rows])
    if part:
        peak_flops, hbm_bandwidth = dict(part.peak_flops), part.hbm_bandwidth
    else:
        peak_flops, hbm_bandwidth = {"bf16": best_bf16, "fp32": median("fp32")}, memory
    # eff(k) = k / (k + k_half), from the forward GEMM at the short k against the large shapes'
    k = results[0]["short_k_inner"]
    k_half = min(4096.0, max(1.0, k * (median("bf16_forward") / max(median("short_k"), 1.0) - 1)))
    fields = dict(
        name=f"calibrated {facts.name}", peak_flops=peak_flops, hbm_bytes=facts.memory_bytes,
        hbm_bandwidth=hbm_bandwidth, sm_count=facts.sm_count,
        matmul_max_fraction=_fraction(best_bf16 / peak_flops["bf16"]),
        attention_fraction=_fraction(median("attention") / peak_flops["bf16"]),
        memory_fraction=_fraction(memory / hbm_bandwidth), launch_seconds=median("gap"),
        dispatch_seconds=0.0, collective_host_seconds=0.0, p2p_host_seconds=0.0,
        comm_overlap=1.0, comm_streams=True, matmul_k_half=k_half,
        attention_seq_half=network.attention_seq_half, attention_block=network.attention_block,
        gpus_per_node=network.gpus_per_node, op_bandwidth=unmeasured | ops, op_bandwidth_table=ops_table,
        matmul_table=gemm_table,
        attention_table=median_measurement([r["attention_table"] for r in results], "attention_table"),
        inter_node_bandwidth=network.inter_node_bandwidth, inter_node_efficiency=network.inter_node_efficiency,
        inter_node_latency=network.inter_node_latency)
    spec = (f"spec peaks and HBM bandwidth of the built-in {part.name}" if part
            else "peaks and memory bandwidth as measured (no built-in part matches the name)")
    if ranks >= 2 and results[0]["table"]:
        table = {kind: {str(ranks): [[size, seconds] for (size, _), seconds in zip(points, nondecreasing(
            [max(r["table"][kind][i][1] for r in results) for i in range(len(points))]))]}
                 for kind, points in results[0]["table"].items()}
        alpha, bandwidth = ring_fit(table["all_reduce"][str(ranks)], ranks)
        fields.update(collective_table=table, intra_node_bandwidth=bandwidth, intra_node_efficiency=1.0,
                      intra_node_latency=alpha)
        net = f"collectives measured over {ranks} ranks; inter-node numbers of the built-in {network.name}"
    else:
        fields.update(collective_table={}, intra_node_bandwidth=network.intra_node_bandwidth,
                      intra_node_efficiency=network.intra_node_efficiency,
                      intra_node_latency=network.intra_node_latency)
        net = f"one rank: no collective measured, the network numbers are the built-in {network.name}'s"
    return DeviceProfile(**fields, notes=f"measured by dynaplane calibrate --device {facts.kind} with {ranks} "
                                         f"rank(s); {spec}; {net}; host costs 0 (the host runs ahead of the "
                                         f"kernels)")


def calibrate_device(ranks: int = 1, requests: list = (), kind: str = "cuda", effort: DeviceEffort = DEVICE,
                     progress=None) -> DeviceProfile:
    """Measure `ranks` devices of `kind` at once (NCCL between GPUs, gloo between CPU
    ranks). `requests`: TraceRequests whose GEMMs and attentions are timed at their own
    shapes and whose collectives at their own sizes."""
    from parallelism.emulator.tracer import trace
    from parallelism.engine.launch import run_ranks

    say = progress or (lambda text: None)
    facts = device_facts(kind, ranks)
    traces = []
    for n, request in enumerate(requests):
        say(f"tracing {request.model} {request.layout} for its op shapes ({n + 1}/{len(requests)})")
        traces.append(trace(request)[0])
    shapes = shapes_by_residency(traces, facts.cache_bytes)
    say(f"measuring {ranks} x {facts.name} (cold ops read past its {facts.cache_bytes / 2**20:.0f} MiB L2/LLC)")
    results = run_ranks(ranks, measure_device_rank, kind, effort, shapes, collective_sizes(traces, ranks),
                        facts.cache_bytes, timeout_s=900, backend="nccl" if kind == "cuda" else "gloo")
    return device_profile(facts, results, ranks)
