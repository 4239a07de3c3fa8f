"""Where a real CPU step and the emulator's prediction of it part, by kind of work.

    .venv/bin/python -m benchmarks.emulator_gap var/cpu-profile.json tp=1,pp=1,dp=2,zero=1

Runs the validation's program (llama-124m on 2 local ranks) for one layout. In the fastest
of three steps on rank 0 it times torch.distributed's eager collectives by kind (the ZeRO
path's and FSDP2's; DTensor's functional ones, tensor parallelism's, stay in forward +
backward), the optimizer net of its collectives, and the rest (forward + backward, and a
pipeline's waits); one more step under torch.profiler gives its matmul and attention
kernels' self time (the profiler's per-op cost inflates everything else, so only those are
read from it). Beside each: the trace's ops priced by the profile one by one, without
overlap or bubble (stage 0's for a pipeline). Prints a markdown table.

With --by-op, rank 0 also profiles its optimizer step alone in three more steps and prints
each op's median self time beside the trace's optimizer ops priced by name (in-place and
_foreach_ variants pooled under the op's name; a clone's or cast's kernel is its copy, so
those pool under "copy"): where a step's optimizer parts from the prediction, op by op.
"""
from __future__ import annotations

import collections

from benchmarks.emulator_validation import GLOBAL_BATCH, MICRO_BATCH, MODEL, SEQ, WORLD

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def kernel_kind(name: str) -> str:
    """"matmul", "attention" or "" for a profiler event's name."""
    if name in MATMULS:
        return "matmul"
    return "attention" if "scaled_dot_product" in name or "flash_attention" in name else ""


TIMED_COLLECTIVES = {"all_reduce": "all_reduce", "all_gather_single": "all_gather",
                     "reduce_scatter_single": "reduce_scatter"}


def _timed(totals: dict, key: str, fn):
    import time

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - started
    return wrapper


def phase_seconds(trainer, totals: dict) -> float:
    """One step with torch.distributed's eager collectives and the optimizer step timed into
    `totals` (cheap: a few hundred calls, unlike the profiler's per-op records); returns
    the step's wall time."""
    import time

    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in TIMED_COLLECTIVES}
    optimizer_step = trainer.optimizer.step
    for name, kind in TIMED_COLLECTIVES.items():
        setattr(dist, name, _timed(totals, kind, saved[name]))

    def comm() -> float:
        return sum(totals[k] for k in TIMED_COLLECTIVES.values())

    def timed_optimizer(*args, **kwargs):
        started, comm_before = time.perf_counter(), comm()
        try:
            return optimizer_step(*args, **kwargs)
        finally:  # the collectives the optimizer issues (ZeRO-1's) count as collectives
            totals["optimizer compute"] += time.perf_counter() - started - (comm() - comm_before)

    trainer.optimizer.step = timed_optimizer
    try:
        started = time.perf_counter()
        trainer.step()
        wall = time.perf_counter() - started
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        trainer.optimizer.step = optimizer_step
    totals["forward + backward (tp collectives in it)"] = wall - totals["optimizer compute"] - comm()
    return wall


def op_family(name: str) -> str:
    """A profiler event's or a trace op's name without its namespace, _foreach_ prefix and
    in-place suffix; clones and casts as "copy" (their kernel is a copy_)."""
    base = name.split("::")[-1].removeprefix("_foreach_").rstrip("_")
    return "copy" if base in ("clone", "_to_copy", "to", "copy") else base


def optimizer_op_seconds(trainer, steps: int = 3) -> dict[str, float]:
    """{op family: median over `steps` steps of its self CPU seconds in the optimizer step},
    the optimizer profiled alone (few, large ops: the profiler's per-op cost is negligible)."""
    import statistics

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    step, tables = trainer.optimizer.step, []

    def profiled(*args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = step(*args, **kwargs)
        table: dict[str, float] = collections.defaultdict(float)
        for event in prof.key_averages():
            if event.key.startswith("aten::"):
                table[op_family(event.key)] += event.self_cpu_time_total / 1e6
        tables.append(table)
        return out

    trainer.optimizer.step = profiled
    try:
        for _ in range(steps):
            dist.barrier()
            trainer.step()
    finally:
        trainer.optimizer.step = step
    return {name: statistics.median(t.get(name, 0.0) for t in tables) for name in set().union(*tables)}


def profiled_rank(rank: int, world: int, layout: str, global_batch: int, seq: int, by_op: bool = False,
                  warmup: int = 2, steps: int = 3) -> dict:
    """The fastest of `steps` timed steps (phase_seconds), then one step under torch.profiler
    for the self CPU time of its matmuls and attention."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from parallelism.emulator.real_steps import prepared_trainer

    trainer, _ = prepared_trainer(MODEL, layout, rank, global_batch, MICRO_BATCH, seq, warmup + 2 * steps + 1)
    for _ in range(warmup):
        trainer.step()
    best: dict = {}
    for _ in range(steps):
        dist.barrier()
        totals: dict[str, float] = collections.defaultdict(float)
        wall = phase_seconds(trainer, totals)
        if not best or wall < best["wall"]:
            best = {"wall": wall, "categories": dict(totals)}
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step()
    kernels = dict.fromkeys(("matmul", "attention"), 0.0)
    for event in prof.key_averages():
        if kind := kernel_kind(event.key):
            kernels[kind] += event.self_cpu_time_total / 1e6
    best["kernels"] = kernels
    if by_op:
        best["optimizer ops"] = optimizer_op_seconds(trainer, steps)
    return best


def predicted(profile_path: str, layout: str, global_batch: int, seq: int) -> dict[str, float]:
    """The trace's ops priced one by one (no overlap, no bubble) in the categories of
    phase_seconds, plus its matmuls and attentions alone. Stage 0's ops for a pipeline."""
    from parallelism.emulator.costs import op_seconds
    from parallelism.emulator.devices import load_profile
    from parallelism.emulator.emulate import EmulateRequest, check_request
    from parallelism.emulator.trace import CommOp
    from parallelism.emulator.tracer import TraceRequest, trace

    profile = load_profile(profile_path)
    micro = check_request(EmulateRequest(MODEL, layout, WORLD, "cpu", global_batch, MICRO_BATCH, seq,
                                         gpus_per_node=WORLD, profile=profile_path))
    stage = trace(TraceRequest(MODEL, layout, MICRO_BATCH, seq, micro, WORLD))[0].stages[0]
    out: dict[str, float] = collections.defaultdict(float)

    def add(ops, times, phase: str) -> None:
        for op, n in zip(ops, times):
            seconds = n * op_seconds(op, profile, WORLD)
            if phase == "sync" or (isinstance(op, CommOp) and op.dim in ("dp", "pp")):
                out[op.kind] += seconds
            else:
                out[phase] += seconds
                if not isinstance(op, CommOp) and op.kind in ("matmul", "attention"):
                    out[op.kind] += seconds

    rest = "forward + backward (tp collectives in it)"
    add(stage.forward, [micro] * len(stage.forward), rest)
    add(stage.backward, [micro] * len(stage.backward), rest)
    add(stage.optimizer, [1] * len(stage.optimizer), "optimizer compute")
    add(stage.grad_sync, [micro if stage.grad_sync_each_microbatch else 1] * len(stage.grad_sync), "sync")
    # ZeRO-3 gathers in every micro-batch's forward and backward, ZeRO-1 once after the optimizer
    add(stage.param_sync, [1 if phase == "step" else micro for phase in stage.phases()], "sync")
    for op in stage.optimizer:
        if not isinstance(op, CommOp):
            out[f"optimizer op {op_family(op.name)}"] += op_seconds(op, profile, WORLD)
    return dict(out)


def main(profile_path: str, layout: str, global_batch: int = GLOBAL_BATCH, seq: int = SEQ,
         by_op: bool = False) -> None:
    from parallelism.engine.launch import run_ranks

    real = run_ranks(WORLD, profiled_rank, layout, global_batch, seq, by_op, timeout_s=1800)[0]
    guess = predicted(profile_path, layout, global_batch, seq)
    rows = {**real["categories"], **{f"{k} kernels (profiled step)": v for k, v in real["kernels"].items()}}
    predicted_rows = {**guess, **{f"{k} kernels (profiled step)": guess.get(k, 0.0) for k in real["kernels"]}}
    phases = [k for k in rows if "kernels" not in k and k != "optimizer ops"]
    print(f"{layout}: fastest timed step {real['wall']:.3f} s; the trace's ops priced one by one "
          f"{sum(guess.get(k, 0.0) for k in phases):.3f} s")
    print("| part | real s | predicted s | predicted - real |")
    print("|---|---|---|---|")
    for name, seconds in rows.items():
        if name == "optimizer ops":
            continue
        p = predicted_rows.get(name, 0.0)
        print(f"| {name} | {seconds:.3f} | {p:.3f} | {p - seconds:+.3f} |")
    if by_op:
        ops = real["optimizer ops"]
        names = {*ops, *(k.removeprefix("optimizer op ") for k in guess if k.startswith("optimizer op "))}
        print("\n| optimizer op (rank 0, median of 3 steps) | real s | predicted s | predicted - real |")
        print("|---|---|---|---|")
        for name in sorted(names, key=lambda n: -max(ops.get(n, 0.0), guess.get(f"optimizer op {n}", 0.0))):
            r, p = ops.get(name, 0.0), guess.get(f"optimizer op {name}", 0.0)
            if max(r, p) >= 0.001:
                print(f"| {name} | {r:.3f} | {p:.3f} | {p - r:+.3f} |")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile written by `dynaplane calibrate`")
    parser.add_argument("layout", help="one of the validation's layouts, e.g. tp=1,pp=2,dp=1,zero=1")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--seq", type=int, default=SEQ, help="as the validation's (32 on a CPU without native bf16)")
    parser.add_argument("--by-op", action="store_true",
                        help="also rank 0's optimizer step op by op (profiled alone), against the trace's")
    args = parser.parse_args()
    main(args.profile, args.layout, args.global_batch, args.seq, args.by_op)
