"""The transition engine and a resize on a CUDA machine, in one report (issue 9, "Ready for
a GPU"): what a device session runs once, with everything it needs prepared here.

    python -m benchmarks.gpu_check --out "$OUT"                  (a CUDA machine)
    python -m benchmarks.gpu_check --device cpu --model tiny-gpt  (the same path on CPU ranks:
                                                                    a rehearsal of the script)

1. machine: torch, CUDA and NCCL versions, the GPUs.
2. device work: the pause's work besides moving bytes, on one device, over the model's whole
   state (one replica): the layout digest (parallelism/engine/digest.py) and the pack / unpack
   copies into and out of byte buffers (parallelism/engine/execute.py), in GB/s.
3. engine: `dynaplane bench switch --device cuda` (NCCL, one rank per GPU) growing dp from
   half the GPUs to all of them (at most 8), against DCP checkpoint-restart in the same run;
   skipped, with the reason, on fewer than 2 GPUs (NCCL refuses two ranks on one GPU).
4. stack: `dynaplane up` with one agent managing every GPU (`dynaplane agent --device cuda`),
   a job on half of them resized online to all and back; each transition's pause, transfer,
   bytes and pause phases from the API. Skipped on fewer than 2 GPUs. (The rank processes
   train on the host today: the trainer is not device-aware yet; the report says which
   device the state was on.)

Writes report.json and report.md into --out (default $OUT, else ./gpu-report). Exit 0 when
every check that ran passed (bit-exact, verified), 1 otherwise, 2 when there is no device.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine(device: str) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "host_cpus": os.cpu_count()}
    if device == "cuda":
        out.update(cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
                   gpus=[{"name": torch.cuda.get_device_name(i),
                          "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
                          "sm_count": torch.cuda.get_device_properties(i).multi_processor_count,
                          "l2_mib": round(torch.cuda.get_device_properties(i).L2_cache_size / 2**20, 1)}
                         for i in range(torch.cuda.device_count())])
    return out


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def device_work(model_name: str, device: str, repeats: int = 3) -> dict:
    """Digest and pack/unpack throughput over one replica of the model's state on `device`
    (best of `repeats`, after one warm-up)."""
    import torch

    from parallelism.engine.digest import shard_digest
    from parallelism.engine.state_fill import filled_shards
    from parallelism.layout.catalog import get_model
    from parallelism.layout.placement import place

    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    shards = filled_shards(place(get_model(model_name), "dp=1"), 0, dev)
    nbytes = sum(s.nbytes for s in shards.values())
    buffer = torch.empty(max(s.nbytes for s in shards.values()), dtype=torch.uint8, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def digest() -> None:
        for s in shards.values():
            shard_digest(s)  # (.item() per shard: a sync, as in the engine)

    def pack_unpack() -> None:
        for s in shards.values():
            flat = s.data.reshape(-1).view(torch.uint8)
            buffer[:flat.numel()].copy_(flat)
            flat.copy_(buffer[:flat.numel()])
        sync()

    out = {"state_bytes": nbytes, "shards": len(shards)}
    for name, fn in (("digest", digest), ("pack_unpack", pack_unpack)):
        fn()
        best = float("inf")
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - started)
        out[f"{name}_seconds"] = best
        out[f"{name}_gbps"] = _rate(nbytes * (2 if name == "pack_unpack" else 1), best)
    return out


def engine(model_name: str, device: str, gpus: int) -> dict:
    world = min(8, gpus) // 2 * 2
    if world < 2:
        return {"skipped": f"{gpus} GPU(s): the NCCL engine bench needs 2 (one rank per GPU)"}
    argv = [sys.executable, "-m", "dynaplane", "bench", "switch", "--model", model_name, "--world", str(world),
            "--from", f"dp={world // 2}", "--to", f"dp={world}", "--device", device, "--json"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode not in (0, 1):
        return {"error": done.stderr[-3000:], "command": " ".join(argv[2:])}
    result = json.loads(done.stdout)
    result["command"] = "dynaplane " + " ".join(argv[3:])
    return result


def stack_resize(model_name: str, device: str, gpus: int, timeout: float = 600.0) -> dict:
    if gpus < 2:
        return {"skipped": f"{gpus} GPU(s): a resize needs 2"}
    from tests.support.stack import StackProcess, wait_for, wait_for_transition_end

    small, large = gpus // 2, gpus
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        stack = StackProcess(Path(tmp), agents=0, gpus_per_agent=1, env={"DATABASE_URL": None, "REDIS_URL": None})
        stack.start()
        agent = None
        try:
            stack.wait_ready(timeout=180)
            env = {**stack.env, **stack.agent_env("gpu-node"), "DYNAPLANE_VAR_DIR": tmp}
            gpus_arg = "0" if device == "cuda" else str(gpus)  # cuda: every GPU; cpu: virtual ones
            agent = subprocess.Popen([sys.executable, "-m", "dynaplane", "agent", "--name", "gpu-node", "--device",
                                      device, "--gpus", gpus_arg], env=env, cwd=ROOT, start_new_session=True,
                                     stdout=open(Path(tmp) / "agent.log", "wb"), stderr=subprocess.STDOUT)
            wait_for(lambda: stack.get("api/health")["gpus"]["total"] >= large, timeout=120)
            job = stack.post("api/jobs", {"name": "gpu-check", "model": model_name, "gpus": small,
                                          "global_batch": 4 * large, "seq_len": 128})
            wait_for(lambda: stack.get(f"api/jobs/{job['id']}", token=True)["state"] == "running", timeout=timeout)
            for target in (large, small):
                transition = stack.post(f"api/jobs/{job['id']}/resize", {"gpus": target})
                done, _ = wait_for_transition_end(stack, transition["id"], timeout=timeout)
                rows.append({key: done.get(key) for key in (
                    "source_layout", "destination_layout", "state", "pause_seconds", "transfer_seconds",
                    "verify_seconds", "prepare_seconds", "network_bytes")}
                    | {"verified": (done.get("verification") or {}).get("verified"),
                       "phases": (done.get("verification") or {}).get("phases")})
                wait_for(lambda: stack.get(f"api/jobs/{job['id']}", token=True)["state"] == "running", timeout=120)
            stack.post(f"api/jobs/{job['id']}/stop", {})
        except BaseException as exc:  # the report keeps what ran, and why the rest did not
            rows.append({"error": f"{type(exc).__name__}: {exc}"[:3000], "stack_output": stack.output()[-3000:]})
        finally:
            if agent is not None:
                agent.terminate()
                agent.wait(timeout=30)
            stack.stop()
    return {"gpus": [small, large], "transitions": rows}


def markdown(report: dict) -> str:
    m, w, e, s = report["machine"], report["device_work"], report["engine"], report["stack"]
    lines = [f"# gpu_check {report['date']}", "",
             f"torch {m['torch']}, device {m['device']}"
             + (f", CUDA {m['cuda']}, NCCL {m['nccl']}, GPUs: "
                + ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in m["gpus"]) if m["device"] == "cuda" else ""),
             "", f"## Device work ({report['model']}, {w['state_bytes'] / 2**30:.2f} GiB of state, {w['shards']} shards)",
             f"- digest: {w['digest_seconds']:.3f} s ({w['digest_gbps']:.1f} GB/s)",
             f"- pack + unpack: {w['pack_unpack_seconds']:.3f} s ({w['pack_unpack_gbps']:.1f} GB/s moved)", "",
             "## Engine (NCCL)" if m["device"] == "cuda" else "## Engine (gloo)"]
    if "skipped" in e or "error" in e:
        lines.append(f"- {e.get('skipped') or e.get('error')}")
    else:
        lines.append(f"- `{e['command']}`: switch {e['switch_seconds']:.3f} s, checkpoint-restart "
                     f"{e['checkpoint_seconds']:.3f} s ({e['speedup']:.1f}x), {e['network_bytes'] / 2**20:.0f} MiB at "
                     f"{e['achieved_gbps']:.2f} GB/s (raw p2p {e['p2p_gbps']:.2f} GB/s), bit-exact {e['bitexact']}")
    lines += ["", "## Resize through the stack"]
    if "skipped" in s:
        lines.append(f"- {s['skipped']}")
    for row in s.get("transitions", []):
        if "error" in row:
            lines.append(f"- error: {row['error']}")
            continue
        lines.append(f"- {row['source_layout']} -> {row['destination_layout']}: {row['state']}, pause "
                     f"{row['pause_seconds']:.3f} s, transfer {row['transfer_seconds']:.3f} s, "
                     f"{(row['network_bytes'] or 0) / 2**20:.0f} MiB, verified {row['verified']}")
    return "\n".join(lines) + "\n"


def passed(report: dict) -> bool:
    e, s = report["engine"], report["stack"]
    ok = "error" not in e and ("skipped" in e or e.get("bitexact") is True)
    return ok and all(row.get("state") == "committed" and row.get("verified") for row in s.get("transitions", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="llama-124m")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: every one; cpu: virtual GPUs, default 4)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-report"))
    parser.add_argument("--skip-stack", action="store_true", help="sections 1-3 only")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); --device cpu rehearses the "
              "script on CPU ranks", file=sys.stderr)
        return 2
    gpus = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 4)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
              "machine": machine(args.device)}
    for name, fn in (("device_work", lambda: device_work(args.model, args.device)),
                     ("engine", lambda: engine(args.model, args.device, gpus)),
                     ("stack", lambda: {"skipped": "--skip-stack"} if args.skip_stack
                      else stack_resize(args.model, args.device, gpus))):
        started = time.perf_counter()
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        report[name] = fn()
        print(f"gpu_check: {name} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
