"""The emulator against the `dynaplane train` command itself (issue 5's validation, the
issue's own wording: real multi-process CPU runs of `dynaplane train`).

    .venv/bin/python -m benchmarks.emulator_train_check var/cpu-profile.json --seq 32 --global-batch 2

`benchmarks.emulator_validation` times the trainer's steps inside its own rank processes with
the batches made ahead (so that it can pool many rounds and read the memory of the ranks);
this runs `dynaplane train --json` as a user would, one process per rank, data made each step,
and reads the step times the command reports, against `emulate --gpu cpu --profile` of the
same configuration. The first WARMUP steps are dropped (allocator and thread-pool warm-up).
With --calibrate the profile is measured first, right before the runs (a one-pass calibration
of these layouts' shapes, as emulator_validation's rounds take), so that both sample the same
stretch of time on a drifting host.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.emulator_validation import GLOBAL_BATCH, LAYOUTS, MICRO_BATCH, MODEL, SEQ, calibrate_now, predicted

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 2


def train_steps(layout: str, steps: int, global_batch: int, seq: int) -> list[float]:
    """Step seconds `dynaplane train` reports for `layout`, warm-up steps dropped."""
    from parallelism.layout.spec import parse_layout

    dp = parse_layout(layout).modules[0].dp
    command = [sys.executable, "-m", "dynaplane", "train", "--model", MODEL, "--layout", layout,
               "--steps", str(steps), "--global-batch", str(global_batch), "--seq", str(seq),
               "--micro-batches", str(global_batch // (MICRO_BATCH * dp)), "--timeout", "1800", "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout[proc.stdout.index("\n{") + 1:])  # progress lines, then the JSON
    return [s["seconds"] for s in report["steps"]][WARMUP:]


def main(profile: str, global_batch: int, seq: int, steps: int, calibrate: bool = False) -> None:
    if calibrate:
        print(f"calibrating into {profile} ...", flush=True)
        calibrate_now(profile, global_batch, seq)
    print("| layout | `dynaplane train` step s (fastest / median) | emulated step s | error (fastest / median) |")
    print("|---|---|---|---|")
    errors, median_errors = [], []
    for layout in LAYOUTS:
        real = train_steps(layout, steps, global_batch, seq)
        emulated = predicted(profile, layout, global_batch, seq)["step_seconds"]
        fastest, median = min(real), statistics.median(real)
        errors.append(abs(emulated / fastest - 1))
        median_errors.append(abs(emulated / median - 1))
        print(f"| `{layout}` | {fastest:.3f} / {median:.3f} | {emulated:.3f} | "
              f"{emulated / fastest - 1:+.1%} / {emulated / median - 1:+.1%} |", flush=True)
    print(f"\nmean absolute step-time error: {statistics.mean(errors):.1%} against the fastest step "
          f"`dynaplane train` reported, {statistics.mean(median_errors):.1%} against the median")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile written by `dynaplane calibrate` (written here with --calibrate)")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--steps", type=int, default=8, help=f"steps per layout, the first {WARMUP} dropped")
    parser.add_argument("--calibrate", action="store_true", help="measure PROFILE here first, just before the runs")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps}: give more than the {WARMUP} warm-up steps")
    main(args.profile, args.global_batch, args.seq, args.steps, args.calibrate)
