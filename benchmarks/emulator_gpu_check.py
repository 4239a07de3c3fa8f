"""The emulator against one real GPU, in one report (issue 30): what a device session runs
once, with everything it needs prepared here.

    python -m benchmarks.emulator_gpu_check --out "$OUT"            (a CUDA machine, one GPU)
    python -m benchmarks.emulator_gpu_check --device cpu --model tiny-gpt --out DIR
                                                                     (the same path on CPU: a rehearsal)

(a) machine: torch, CUDA and NCCL versions, the GPUs.
(b) calibrate: `dynaplane calibrate --device cuda --ranks 1 --model M --layout tp=1,pp=1,dp=1
    --seq S --micro-batch B` into OUT/profile.json (parallelism/emulator/calibrate_device.py).
    The rehearsal runs the same measuring code (calibrate_device) on CPU tensors with small
    sizes, in this process: `calibrate --device cpu` is the CPU calibration, another path.
(c) step: the real training step, ParallelTrainer itself in a one-rank world (NCCL, its bf16
    parameters and fp32 AdamW masters and moments on cuda:0, the batches made ahead on the
    device: real_steps.time_device_steps), the median of a few steps after warm-up, each
    cuda-synchronized, and the allocator's peak (torch.cuda.max_memory_allocated).
(d) emulate: the same step (layout tp=1,pp=1,dp=1, one GPU, same seq and micro-batch) on
    OUT/profile.json and on the built-in profile (h200; the rehearsal: cpu).
(e) report.json + report.md: measured against predicted step seconds and peak memory, error %.

Model: --model (default llama-124m on cuda, the catalog's largest model that one GPU trains
with unsharded AdamW state: it has no ~1B model; tiny-gpt for the rehearsal). Micro-batch:
--micro-batch, else the largest of 16, 8, 4, 2, 1 whose step the built-in profile predicts
in under 70% of the device's memory. A failed section is reported with its error and the
others still run. Exit 0 when every section ran, 1 otherwise, 2 when --device cuda finds no
GPU. Budget: well under 8 minutes on one H200 (progress lines carry the elapsed seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.gpu_check import machine  # the same machine section as the engine's device check

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = "tp=1,pp=1,dp=1"
STARTED = time.monotonic()
GiB = 2**30


def say(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f} s] emulator_gpu_check: {text}", file=sys.stderr, flush=True)


def predicted(model: str, seq: int, micro_batch: int, micro_batches: int, gpu: str, profile: str | None = None) -> dict:
    """`dynaplane emulate`'s object for the step (one GPU, tp=1,pp=1,dp=1)."""
    from parallelism.emulator.emulate import EmulateRequest, emulate

    request = EmulateRequest(model, LAYOUT, 1, gpu, micro_batch * micro_batches, micro_batch, seq, gpus_per_node=1,
                             profile=profile)
    r = emulate(request)
    return {"profile": profile or gpu, "gpu": r["gpu"], "step_seconds": r["step_seconds"],
            "peak_bytes": r["memory"]["peak_bytes"], "fits": r["memory"]["fits"], "breakdown": r["breakdown"],
            "mfu": r["mfu"], "trace_cached": r["trace_cached"]}


def choose_micro_batch(model: str, seq: int, builtin: str, capacity: float) -> tuple[int, dict]:
    """The largest of 16, 8, 4, 2, 1 whose predicted peak is under 70% of `capacity` bytes
    (room for what the emulator does not count: the allocator's fragmentation, cuBLAS
    workspaces), with its prediction on the built-in profile."""
    for micro_batch in (16, 8, 4, 2, 1):
        result = predicted(model, seq, micro_batch, 1, builtin)
        say(f"micro-batch {micro_batch}: predicted peak {result['peak_bytes'] / GiB:.1f} GiB of "
            f"{capacity / GiB:.1f} GiB")
        if result["peak_bytes"] <= 0.7 * capacity or micro_batch == 1:
            return micro_batch, result
    raise AssertionError("unreachable")


def calibrate_cuda(model: str, seq: int, micro_batch: int, out: Path, quick: bool) -> dict:
    """(b) on a GPU: the CLI, as a user runs it."""
    command = [sys.executable, "-m", "dynaplane", "calibrate", "--device", "cuda", "--ranks", "1", "--model", model,
               "--layout", LAYOUT, "--seq", str(seq), "--micro-batch", str(micro_batch), "--out", str(out)]
    if quick:
        command.append("--quick")
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=420)
    if done.returncode != 0:
        raise RuntimeError(f"calibrate exited {done.returncode}: {done.stdout[-2000:]}")
    return {"command": " ".join(["dynaplane", *command[3:]]), "seconds": round(time.monotonic() - started, 1),
            "summary": done.stdout.strip()}


# The rehearsal's sizes: the device path's code on small CPU tensors (a GPU's sizes take
# hours on two cores).
def rehearsal_effort():
    from parallelism.emulator.calibrate_device import DeviceEffort

    return DeviceEffort(repeats=3, gemm_shapes=((256, 256, 256),), short_k=(256, 256, 32),
                        attention_shape=(1, 4, 128, 16), bandwidth_tensors=2, op_sizes=(1 << 12, 1 << 18),
                        table_sizes=(), gap_kernels=50)


def calibrate_cpu(model: str, seq: int, micro_batch: int, out: Path) -> dict:
    """(b) rehearsed: calibrate_device on CPU tensors (one gloo rank), small sizes."""
    from parallelism.emulator.calibrate_device import calibrate_device
    from parallelism.emulator.devices import save_profile
    from parallelism.emulator.tracer import TraceRequest

    started = time.monotonic()
    profile = calibrate_device(1, [TraceRequest(model, LAYOUT, micro_batch, seq, 1, 1)], "cpu", rehearsal_effort(),
                               say)
    save_profile(profile, out)
    return {"command": f"calibrate_device(1, [{model} {LAYOUT} seq {seq} micro-batch {micro_batch}], 'cpu', "
                       "rehearsal sizes)", "seconds": round(time.monotonic() - started, 1)}


def real_step(model: str, seq: int, micro_batch: int, device: str, warmup: int, measured: int) -> dict:
    """(c) ParallelTrainer's step in a one-rank world on the device (real_steps.time_device_steps)."""
    from parallelism.emulator.real_steps import time_device_steps
    from parallelism.engine.launch import run_ranks

    return run_ranks(1, time_device_steps, model, seq, micro_batch, 1, device, warmup, measured, timeout_s=300,
                     backend="nccl" if device == "cuda" else "gloo")[0]


def error_pct(predicted_value: float, measured_value: float) -> float:
    return round(100.0 * (predicted_value - measured_value) / measured_value, 1)


def comparison(step: dict, predictions: list[dict]) -> list[dict]:
    return [{"profile": p["profile"], "gpu": p["gpu"],
             "predicted_step_seconds": p["step_seconds"], "measured_step_seconds": step["seconds"],
             "step_error_pct": error_pct(p["step_seconds"], step["seconds"]),
             "predicted_peak_gib": round(p["peak_bytes"] / GiB, 3), "measured_peak_gib": round(step["peak_bytes"] / GiB, 3),
             "peak_error_pct": error_pct(p["peak_bytes"], step["peak_bytes"])} for p in predictions]


def markdown(report: dict) -> str:
    m, c = report["machine"], report["config"]
    lines = [f"# Emulator against a real {m['device']} step", "",
             f"torch {m['torch']}" + (f", CUDA {m['cuda']}, NCCL {m['nccl']}" if m["device"] == "cuda" else "")
             + "".join(f"; {g['name']} ({g['memory_gib']} GiB, {g['sm_count']} SMs)" for g in m.get("gpus", [])), "",
             f"{c['model']} {c['layout']}, seq {c['seq']}, micro-batch {c['micro_batch']}, one GPU", ""]
    for name in ("calibrate", "step"):
        section = report.get(name, {})
        if "error" in section:
            lines.append(f"- {name}: FAILED: {section['error'].splitlines()[-1] if section['error'] else ''}")
    if "calibrate" in report and "seconds" in report["calibrate"]:
        lines.append(f"- calibrate: `{report['calibrate']['command']}` in {report['calibrate']['seconds']} s")
    if "seconds" in report.get("step", {}):
        s = report["step"]
        lines.append(f"- real step: median {s['seconds'] * 1e3:.1f} ms of "
                     + ", ".join(f"{t * 1e3:.1f}" for t in s["all_seconds"]) + f" ms; peak {s['peak_bytes'] / GiB:.2f} GiB")
    if report.get("comparison"):
        lines += ["", "| profile | predicted step s | measured step s | error | predicted peak GiB | measured peak GiB "
                      "| error |", "|---|---|---|---|---|---|---|"]
        for r in report["comparison"]:
            lines.append(f"| {r['gpu']} | {r['predicted_step_seconds']:.4f} | {r['measured_step_seconds']:.4f} | "
                         f"{r['step_error_pct']:+.1f}% | {r['predicted_peak_gib']:.2f} | {r['measured_peak_gib']:.2f} | "
                         f"{r['peak_error_pct']:+.1f}% |")
    for p in report.get("predictions", []):
        lines.append(f"- {p['gpu']} breakdown: " + ", ".join(f"{k} {v:.4f} s" for k, v in p["breakdown"].items()))
    lines += ["", f"total {report['seconds']:.0f} s", ""]
    return "\n".join(lines)


def _section(report: dict, name: str, work) -> object:
    """Run one section; its error goes into the report and the run goes on."""
    say(f"{name} ...")
    started = time.monotonic()
    try:
        value = work()
    except Exception as exc:  # a one-shot device session keeps whatever else it can measure
        report[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        say(f"{name} FAILED after {time.monotonic() - started:.0f} s: {type(exc).__name__}: {exc}")
        return None
    say(f"{name} done in {time.monotonic() - started:.0f} s")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default=None, help="default llama-124m (cuda), tiny-gpt (cpu)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (cuda), 64 (cpu)")
    parser.add_argument("--micro-batch", type=int, default=0, help="0: the largest that fits (see above)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--quick", action="store_true", help="calibrate --quick")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "emulator-gpu-report"))
    args = parser.parse_args(argv)
    global STARTED
    STARTED = time.monotonic()
    cuda = args.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            print("emulator_gpu_check: no CUDA device here (torch.cuda.is_available() is False); --device cpu "
                  "rehearses the script", file=sys.stderr)
            return 2
    model = args.model or ("llama-124m" if cuda else "tiny-gpt")
    seq = args.seq or (2048 if cuda else 64)
    builtin = "h200" if cuda else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    profile_path = args.out / "profile.json"
    report: dict = {"config": {"model": model, "layout": LAYOUT, "seq": seq, "device": args.device,
                               "builtin_profile": builtin}}
    report["machine"] = machine(args.device)
    say(f"machine: {json.dumps(report['machine'])}")
    micro_batch = args.micro_batch
    if not micro_batch:
        import torch

        from parallelism.emulator.devices import get_profile

        capacity = torch.cuda.get_device_properties(0).total_memory if cuda else get_profile("cpu").hbm_bytes
        chosen = _section(report, "micro_batch", lambda: choose_micro_batch(model, seq, builtin, capacity))
        micro_batch = chosen[0] if chosen else 1
    report["config"]["micro_batch"] = micro_batch
    calibrated = _section(report, "calibrate", lambda: (calibrate_cuda(model, seq, micro_batch, profile_path, args.quick)
                                                        if cuda else calibrate_cpu(model, seq, micro_batch, profile_path)))
    if calibrated is not None:
        report["calibrate"] = calibrated
    step = _section(report, "step", lambda: real_step(model, seq, micro_batch, args.device, args.warmup, args.steps))
    if step is not None:
        report["step"] = step
        say(f"real step: median {step['seconds'] * 1e3:.1f} ms, peak {step['peak_bytes'] / GiB:.2f} GiB")
    profiles = ([str(profile_path)] if calibrated is not None else []) + [None]
    predictions = []
    for profile in profiles:
        p = _section(report, f"emulate {profile or builtin}",
                     lambda profile=profile: predicted(model, seq, micro_batch, 1, builtin, profile))
        if p is not None:
            predictions.append(p)
            say(f"predicted on {p['gpu']}: {p['step_seconds'] * 1e3:.1f} ms, peak {p['peak_bytes'] / GiB:.2f} GiB")
    report["predictions"] = predictions
    report["comparison"] = comparison(step, predictions) if step is not None else []
    report["seconds"] = round(time.monotonic() - STARTED, 1)
    report["ok"] = not any(isinstance(v, dict) and "error" in v for v in report.values())
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
