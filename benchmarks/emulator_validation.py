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

With --calibrate-each-round the benchmark measures the profile itself: a one-pass
`dynaplane calibrate` of these layouts' shapes before each round, and PROFILE the median
of them (`calibrate --merge`), so that the calibration and the real steps sample the same
stretch of time; a calibration taken minutes before the real runs carries whatever spell
the host was in then (session 9: two calibrations twelve minutes apart differed by a fifth
in their memory-bound rates, the real steps did not move). Each round's calibration alone
is scored too, as is every --also PROFILE. And paired: each round's calibration against that
round's own fastest steps (paired_error), beside the pooled figure (the median calibration
against every round's fastest step), for when the machine's speed moves between rounds.

On a CPU without native bf16 (AVX2: bf16 GEMMs at 1-10 GFLOP/s) run both commands with
--seq 32 --global-batch 2: a step at the defaults takes minutes there.
"""
from __future__ import annotations

import os
import statistics

MODEL, GLOBAL_BATCH, MICRO_BATCH, SEQ, WORLD = "llama-124m", 4, 1, 128, 2
LAYOUTS = ["tp=2,pp=1,dp=1,zero=1", "tp=1,pp=1,dp=2,zero=1", "tp=1,pp=1,dp=2,zero=3", "tp=1,pp=2,dp=1,zero=1",
           "tp=1,pp=2,dp=1,zero=0"]
WARMUP, MEASURED = 2, 6


def real_rank(rank: int, world: int, layout: str, global_batch: int, seq: int) -> dict:
    from parallelism.emulator.real_steps import time_steps

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


def round_spread(fastest_per_round: list[float]) -> float | None:
    """How far the real runs disagree with themselves: the mean over rounds of |a round's
    fastest step / the median of the other rounds' fastest steps - 1| (None for one round).
    Even a predictor that knew every other round would miss a round by this much, so a
    step-time error target well under it cannot be scored on the machine at that time."""
    if len(fastest_per_round) < 2:
        return None
    return statistics.mean(abs(x / statistics.median(fastest_per_round[:i] + fastest_per_round[i + 1:]) - 1)
                           for i, x in enumerate(fastest_per_round))


def paired_error(predicted_by_round: list[list[float]], fastest_by_round: list[list[float]]) -> float:
    """Each round's prediction (from the calibration taken just before it) against that
    round's own fastest real steps: the mean over rounds and layouts of |predicted / real - 1|.
    The machine drifts between rounds (session 23: one round ran 11-24% faster than the
    others), so a prediction is scored against the steps measured in its own stretch of time."""
    pairs = [(p, f) for ps, fs in zip(predicted_by_round, fastest_by_round, strict=True)
             for p, f in zip(ps, fs, strict=True)]
    return statistics.mean(abs(p / f - 1) for p, f in pairs)


def calibrate_now(out: str, global_batch: int, seq: int) -> None:
    """One single-pass `dynaplane calibrate` of these layouts' shapes, as the docstring's command."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "dynaplane", "calibrate", "--out", out, "--ranks", str(WORLD), "--passes", "1",
               "--model", MODEL, "--seq", str(seq), "--global-batch", str(global_batch)]
    for layout in LAYOUTS:
        command += ["--layout", layout]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def predicted(profile: str, layout: str, global_batch: int, seq: int) -> dict:
    from parallelism.emulator.emulate import EmulateRequest, emulate

    return emulate(EmulateRequest(MODEL, layout, WORLD, "cpu", global_batch, MICRO_BATCH, seq, gpus_per_node=WORLD,
                                  profile=profile))


def main(profile: str, global_batch: int = GLOBAL_BATCH, seq: int = SEQ, rounds: int = 1,
         calibrate_each_round: bool = False, others: tuple = ()) -> None:
    from parallelism.emulator.devices import load_profile, save_profile
    from parallelism.emulator.profile_merge import median_profile, quietest_calibration
    from parallelism.engine.launch import run_ranks

    runs: dict[str, list] = {layout: [] for layout in LAYOUTS}
    loads: dict[str, list] = {layout: [] for layout in LAYOUTS}
    stolen: dict[str, float] = dict.fromkeys(LAYOUTS, 0.0)
    calibrations = []
    for n in range(rounds):
        if calibrate_each_round:
            calibrations.append(f"{profile.removesuffix('.json')}.round{n + 1}.json")
            print(f"round {n + 1}/{rounds}: calibrating into {calibrations[-1]} ...", flush=True)
            calibrate_now(calibrations[-1], global_batch, seq)
        for layout in LAYOUTS:
            loads[layout].append(os.getloadavg()[0])  # other processes on the machine inflate the real steps
            before = steal_seconds()
            runs[layout].append(run_ranks(WORLD, real_rank, layout, global_batch, seq, timeout_s=1800))
            stolen[layout] += steal_seconds() - before
    speeds: list[float] = []
    quietest = None
    if calibrations:
        measured = [load_profile(path) for path in calibrations]
        save_profile(median_profile(measured), profile)
        best, speeds = quietest_calibration(measured)
        quietest = calibrations[best]
        print(f"wrote {profile}: the median of the {len(calibrations)} calibrations, one before each round\n")
    print("| layout | real step s (fastest / median) | emulated step s | error (fastest / median) | "
          "static bytes real = emulated | peak real GiB | peak emulated GiB | peak error | load before | "
          "fastest per round s | steal s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors, median_errors = [], []
    # A step ends on every rank together (time_steps all-reduces each step's max), so rank 0's
    # steps are the step times.
    pooled = {layout: [t for run in runs[layout] for t in run[0]["steps"]] for layout in LAYOUTS}
    for layout in LAYOUTS:
        real, steps = runs[layout][0], pooled[layout]
        per_round = " / ".join(f"{min(run[0]['steps']):.3f}" for run in runs[layout])
        load = max(loads[layout])
        emulated = predicted(profile, layout, global_batch, seq)
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
    if rounds > 1:
        spreads = {layout: round_spread([min(run[0]["steps"]) for run in runs[layout]]) for layout in LAYOUTS}
        print("the real runs' own spread (each round's fastest step against the median of the other rounds'): "
              + ", ".join(f"{spreads[layout]:.1%}" for layout in LAYOUTS)
              + f" (mean {statistics.mean(spreads.values()):.1%})")
    fastest = [min(pooled[layout]) for layout in LAYOUTS]
    medians = [statistics.median(pooled[layout]) for layout in LAYOUTS]
    means, alone_by_path = {}, {}
    for n, path in enumerate([*calibrations, *others]):  # how far one calibration alone lands
        alone = alone_by_path[path] = [predicted(path, layout, global_batch, seq)["step_seconds"] for layout in LAYOUTS]
        means[path] = statistics.mean(abs(a / f - 1) for a, f in zip(alone, fastest))
        speed = f", machine speed {speeds[n]:.3f}" if n < len(speeds) else ""
        print(f"{path} alone{speed}: " + ", ".join(f"{a / f - 1:+.1%}" for a, f in zip(alone, fastest))
              + f" (mean {means[path]:.1%} against the fastest, "
              f"{statistics.mean(abs(a / m - 1) for a, m in zip(alone, medians)):.1%} against the median)")
    if calibrations:
        fastest_by_round = [[min(runs[layout][n][0]["steps"]) for layout in LAYOUTS] for n in range(rounds)]
        by_round = [alone_by_path[path] for path in calibrations]
        print(f"paired, each round's calibration against that round's fastest steps: mean "
              f"{paired_error(by_round, fastest_by_round):.1%} ("
              + "; ".join(f"round {n + 1}: " + ", ".join(f"{p / f - 1:+.1%}" for p, f in zip(ps, fs))
                          for n, (ps, fs) in enumerate(zip(by_round, fastest_by_round)))
              + f"); pooled, the median calibration against every round's fastest: {statistics.mean(errors):.1%}")
    if quietest and len(calibrations) > 1:
        # Like for like: the fastest real step is the machine at its least disturbed, and so
        # is the calibration taken while it ran fastest (`calibrate --merge ... --quietest`).
        print(f"the quietest calibration ({quietest}, chosen by its own measurements) against the fastest "
              f"real steps: mean {means[quietest]:.1%}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile written by `dynaplane calibrate` (written here with "
                                        "--calibrate-each-round)")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--seq", type=int, default=SEQ,
                        help="shorter on a CPU without native bf16 (its bf16 GEMMs run at ~1 GFLOP/s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the layouts this many times in turn and pool their steps (the machine drifts)")
    parser.add_argument("--calibrate-each-round", action="store_true",
                        help="measure the profile here: a one-pass calibration before each round, PROFILE their "
                             "median (so the calibration and the real steps sample the same stretch of time)")
    parser.add_argument("--also", action="append", default=[], metavar="PROFILE",
                        help="print the mean errors of this profile too, against the same real steps")
    args = parser.parse_args()
    main(args.profile, args.global_batch, args.seq, args.rounds, args.calibrate_each_round, tuple(args.also))
