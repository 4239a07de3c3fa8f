"""Wall time of `dynaplane emulate` against the GPU count (issue 5).

    .venv/bin/python -m benchmarks.emulator_scaling [--gpus 1024 2048 ...]

llama3-405b, seq 8192, tp=8, pp=16, zero=1, micro-batch 1, dp = GPUs / 128, global batch
32 sequences per DP replica (2048 = 16M tokens at 8,192 GPUs, as in the Llama 3 run). Each
point is one `dynaplane emulate --no-cache --json` process, run one at a time: "command
wall" includes interpreter start and imports, "emulate wall" is the command's own
`wall_seconds` (tracing the stage classes, two processes at a time, plus the simulation).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_point(gpus: int, gpu: str = "h100") -> dict:
    dp = gpus // 128
    layout = f"tp=8,pp=16,dp={dp},zero=1"
    command = [str(ROOT / ".venv" / "bin" / "dynaplane"), "emulate", "--model", "llama3-405b", "--layout", layout,
               "--gpus", str(gpus), "--gpu", gpu, "--global-batch", str(32 * dp), "--micro-batch", "1",
               "--seq", "8192", "--no-cache", "--json"]
    with tempfile.TemporaryDirectory() as cache:  # belt and braces: --no-cache, and an empty cache dir
        env = dict(os.environ, DYNAPLANE_TRACE_CACHE=cache)
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - started
    if proc.returncode not in (0, 3):  # 3: ran, but the configuration does not fit
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout)
    return {"gpus": gpus, "layout": layout, "global_batch": 32 * dp, "command_wall": wall,
            "emulate_wall": result["wall_seconds"], "ranks_traced": result["ranks_traced"],
            "ranks_emulated": result["ranks_emulated"], "step_seconds": result["step_seconds"],
            "mfu": result["mfu"], "command": " ".join(command[1:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    args = parser.parse_args(argv)
    print("| GPUs | layout | global batch | command wall s | emulate wall s | ranks traced | ranks emulated | "
          "predicted step s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gpus in args.gpus:
        r = run_point(gpus)
        print(f"| {gpus:,} | `{r['layout']}` | {r['global_batch']} | {r['command_wall']:.1f} | {r['emulate_wall']:.1f} | "
              f"{r['ranks_traced']} | {r['ranks_emulated']:,} | {r['step_seconds']:.2f} | {r['mfu']:.1%} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
