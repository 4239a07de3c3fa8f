"""The emulator against real CPU runs of the same program (issue 5's validation).

    .venv/bin/dynaplane calibrate --out var/cpu-profile.json --ranks 2 --model llama-124m \
        --layout tp=2,pp=1,dp=1,zero=1 --layout tp=1,pp=1,dp=2,zero=1 --layout tp=1,pp=1,dp=2,zero=3 \
        --layout tp=1,pp=2,dp=1,zero=1 --layout tp=1,pp=2,dp=1,zero=0 --seq 128 --global-batch 4
    .venv/bin/python -m benchmarks.emulator_validation var/cpu-profile.json

(calibrate then times these layouts' GEMMs and attentions at their own shapes; it never
sees a llama-124m step.) For each layout of llama-124m on 2 local ranks: the real
ParallelTrainer runs warm-up steps then measured steps (the fastest step, which the error
is taken against, and the median; batches made ahead: the emulator predicts the training
step, not the data pipeline; peak = the rank's parameters and optimizer
state + the live tensor bytes of one step, gradients included, counted as the tracer
counts them but on real tensors);
`emulate --gpu cpu --profile` predicts the same configuration. Prints a markdown table.

Against the fastest step: a step is thousands of ops, and calibrate times each at its
median (calibrate_ops.typical_seconds), so the prediction is a step of typical ops
without the stalls a shared host adds to whole steps now and then (slow spells of
seconds, the peer rank's hiccups that every collective waits for); the fastest of a
dozen steps is the real step with the fewest of them. The median step is printed too:
on the 2-core validation host it is 5-20% above the fastest.

With --rounds R the layouts run R times, one after the other in turn (A B C D E A B C D E),
and every layout's real steps of all rounds are pooled: the same layout's fastest step moved
by up to 15% between runs minutes apart on the 2-core validation machine, so a layout timed
in one burst carries whatever the machine was doing then. The per-round fastest steps are
printed too, and the CPU time the hypervisor stole while each layout ran (/proc/stat).
"""
from __future__ import annotations

import os
import statistics

MODEL, GLOBAL_BATCH, MICRO_BATCH, SEQ, WORLD = "llama-124m", 4, 1, 128, 2
LAYOUTS = ["tp=2,pp=1,dp=1,zero=1", "tp=1,pp=1,dp=2,zero=1", "tp=1,pp=1,dp=2,zero=3", "tp=1,pp=2,dp=1,zero=1",
           "tp=1,pp=2,dp=1,zero=0"]
WARMUP, MEASURED = 2, 6


def real_rank(rank: int, world: int, layout: str, global_batch: int, seq: int) -> dict:
    from agents.emulator.real_steps import time_steps

    real = time_steps(MODEL, layout, rank, global_batch, MICRO_BATCH, seq, WARMUP, MEASURED)
    return {"step": real.seconds, "fastest": real.fastest, "static": real.static_bytes, "peak": real.peak_bytes,
            "steps": list(real.all_seconds)}


def steal_seconds() -> float:
    """CPU time the hypervisor gave to other guests since boot, all CPUs (/proc/stat's
    `steal`; 0 where it cannot be read). Steal during a layout's steps inflates them."""
    try:
        fields = open("/proc/stat").readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def main(profile: str, global_batch: int = GLOBAL_BATCH, seq: int = SEQ, rounds: int = 1) -> None:
    from agents.emulator.emulate import EmulateRequest, emulate
    from agents.engine.launch import run_ranks

    runs: dict[str, list] = {layout: [] for layout in LAYOUTS}
    loads: dict[str, list] = {layout: [] for layout in LAYOUTS}
    stolen: dict[str, float] = dict.fromkeys(LAYOUTS, 0.0)
    for _ in range(rounds):
        for layout in LAYOUTS:
            loads[layout].append(os.getloadavg()[0])  # other processes on the machine inflate the real steps
            before = steal_seconds()
            runs[layout].append(run_ranks(WORLD, real_rank, layout, global_batch, seq, timeout_s=1800))
            stolen[layout] += steal_seconds() - before
    print("| layout | real step s (fastest / median) | emulated step s | error (fastest / median) | "
          "static bytes real = emulated | peak real GiB | peak emulated GiB | peak error | load before | "
          "fastest per round s | steal s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors, median_errors = [], []
    for layout in LAYOUTS:
        real = runs[layout][0]
        # A step ends on every rank together (time_steps all-reduces each step's max), so
        # rank 0's steps are the step times.
        steps = [t for run in runs[layout] for t in run[0]["steps"]]
        per_round = " / ".join(f"{min(run[0]['steps']):.3f}" for run in runs[layout])
        load = max(loads[layout])
        emulated = emulate(EmulateRequest(MODEL, layout, WORLD, "cpu", global_batch, MICRO_BATCH, seq,
                                          gpus_per_node=WORLD, profile=profile))
        stages = emulated["memory"]["per_stage"]
        real_step, real_median = min(steps), statistics.median(steps)
        error = emulated["step_seconds"] / real_step - 1
        median_error = emulated["step_seconds"] / real_median - 1
        errors.append(abs(error))
        median_errors.append(abs(median_error))
        static_real = [r["static"] for r in real]
        static_emulated = [s["params"] + s["grads"] + s["optimizer"] for s in stages]
        peak_real = max(r["peak"] for r in real)
        peak_emulated = emulated["memory"]["peak_bytes"]
        print(f"| `{layout}` | {real_step:.3f} / {real_median:.3f} | {emulated['step_seconds']:.3f} | "
              f"{error:+.1%} / {median_error:+.1%} | "
              f"{max(static_real) == max(static_emulated)} ({max(static_real):,}) | {peak_real / 2**30:.3f} | "
              f"{peak_emulated / 2**30:.3f} | {peak_emulated / peak_real - 1:+.1%} | {load:.1f} | {per_round} | "
              f"{stolen[layout]:.1f} |",
              flush=True)
    print(f"\nmean absolute step-time error: {statistics.mean(errors):.1%} against the fastest real step, "
          f"{statistics.mean(median_errors):.1%} against the median")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile written by `dynaplane calibrate`")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--seq", type=int, default=SEQ,
                        help="shorter on a CPU without native bf16 (its bf16 GEMMs run at ~1 GFLOP/s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the layouts this many times in turn and pool their steps (the machine drifts)")
    args = parser.parse_args()
    main(args.profile, args.global_batch, args.seq, args.rounds)
