"""A step's timeline, real against emulated, action by action.

    .venv/bin/python -m benchmarks.emulator_timeline var/cpu-profile.json tp=1,pp=2,dp=1,zero=1 --seq 32 --global-batch 2

Runs the validation's program (llama-124m on 2 local ranks) for any of its layouts. Every
rank times its forward and backward of each micro-batch and its optimizer step, from the
step's start, in the fastest of a few steps: in a pipeline torch's
`PipelineStage.forward_one_chunk` / `backward_one_chunk`; otherwise the forward from the
model's first module to the loss's `backward()` (the loss included, as the trace has it)
and that call. The simulator's events for the same configuration
(`simulate(..., record_events=True)`) are printed beside them. Where the
validation's error on a pipeline row comes from (session 24: each stage's last backward
ran 19 ms longer than its first, while the emulator prices both alike) shows here as the
actions whose durations or starts part.
"""
from __future__ import annotations

import time

from benchmarks.emulator_validation import MICRO_BATCH, MODEL, WORLD

KINDS = {"F": "forward", "B": "backward", "OPT": "optimizer"}


def timed_rank(rank: int, world: int, layout: str, global_batch: int, seq: int, warmup: int = 2,
               steps: int = 5) -> dict:
    """The fastest of `steps` steps: its wall time and its (kind, start, end) actions, seconds
    from the step's start."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from parallelism.emulator.real_steps import prepared_trainer

    events: list[tuple[str, float, float]] = []
    origin = [0.0]

    def timed(method, kind: str):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                events.append((kind, started - origin[0], time.perf_counter() - origin[0]))
        return run

    saved = {name: getattr(PipelineStage, name) for name in ("forward_one_chunk", "backward_one_chunk")}
    PipelineStage.forward_one_chunk = timed(saved["forward_one_chunk"], "forward")
    PipelineStage.backward_one_chunk = timed(saved["backward_one_chunk"], "backward")
    saved_backward = torch.Tensor.backward
    try:
        trainer, _ = prepared_trainer(MODEL, layout, rank, global_batch, MICRO_BATCH, seq, warmup + steps + 1)
        if trainer.pipeline is None:  # forward: the stage's first call to the loss's backward()
            forward_started = [0.0]
            trainer.stage.register_forward_pre_hook(lambda *_: forward_started.__setitem__(0, time.perf_counter()))

            def backward(tensor, *args, **kwargs):
                events.append(("forward", forward_started[0] - origin[0], time.perf_counter() - origin[0]))
                return timed(saved_backward, "backward")(tensor, *args, **kwargs)

            torch.Tensor.backward = backward
        trainer.optimizer.step = timed(trainer.optimizer.step, "optimizer")
        best: dict = {}
        for n in range(warmup + steps):
            dist.barrier()
            events.clear()
            origin[0] = time.perf_counter()
            trainer.step()
            wall = time.perf_counter() - origin[0]
            if n >= warmup and (not best or wall < best["wall"]):
                best = {"wall": wall, "events": list(events)}
    finally:
        for name, method in saved.items():
            setattr(PipelineStage, name, method)
        torch.Tensor.backward = saved_backward
    return best


def emulated_events(profile_path: str, layout: str, global_batch: int, seq: int) -> tuple[float, list]:
    """The simulator's step and its (rank, kind, start, end) actions for the same run."""
    from parallelism.emulator.devices import load_profile
    from parallelism.emulator.emulate import EmulateRequest, as_run, check_request
    from parallelism.emulator.simulate import simulate
    from parallelism.emulator.tracer import TraceRequest, trace

    request = EmulateRequest(MODEL, layout, WORLD, "cpu", global_batch, MICRO_BATCH, seq, gpus_per_node=WORLD,
                             profile=profile_path)
    micro = check_request(request)
    traced, _ = trace(TraceRequest(MODEL, layout, MICRO_BATCH, seq, micro, WORLD))
    sim = simulate(as_run(traced, request), load_profile(profile_path), WORLD, request.recompute, record_events=True)
    return sim.step_seconds, [(e.rank, e.kind, e.start, e.end) for e in sim.events if e.kind in KINDS.values()]


def paired_actions(real: list[list[tuple[str, float, float]]], emulated: list[tuple[int, str, float, float]]
                   ) -> list[tuple[int, str, int, tuple[float, float] | None, tuple[float, float] | None]]:
    """(rank, kind, n, real (start, end), emulated (start, end)) for each rank's n-th action of
    each kind, in the real order (None where one side has fewer). Pure."""
    rows = []
    for rank, actions in enumerate(real):
        theirs: dict[str, list] = {}
        for r, kind, start, end in sorted(emulated, key=lambda e: e[2]):
            if r == rank:
                theirs.setdefault(kind, []).append((start, end))
        seen: dict[str, int] = {}
        for kind, start, end in sorted(actions, key=lambda a: a[1]):
            n = seen[kind] = seen.get(kind, -1) + 1
            other = theirs.get(kind, [])
            rows.append((rank, kind, n, (start, end), other[n] if n < len(other) else None))
        for kind, others in theirs.items():
            rows += [(rank, kind, n, None, others[n]) for n in range(seen.get(kind, -1) + 1, len(others))]
    return rows


def main(profile_path: str, layout: str, global_batch: int, seq: int) -> None:
    from parallelism.engine.launch import run_ranks

    real = run_ranks(WORLD, timed_rank, layout, global_batch, seq, timeout_s=1800)
    step, emulated = emulated_events(profile_path, layout, global_batch, seq)
    print(f"{layout}: real step {max(r['wall'] for r in real):.3f} s (slowest rank of the fastest steps), "
          f"emulated {step:.3f} s")
    print("| rank | action | real start - end ms | emulated start - end ms | duration real / emulated ms |")
    print("|---|---|---|---|---|")
    for rank, kind, n, mine, theirs in paired_actions([r["events"] for r in real], emulated):
        def span(x):
            return f"{x[0] * 1e3:.0f} - {x[1] * 1e3:.0f}" if x else "-"

        def length(x):
            return f"{(x[1] - x[0]) * 1e3:.0f}" if x else "-"

        print(f"| {rank} | {kind} {n + 1} | {span(mine)} | {span(theirs)} | {length(mine)} / {length(theirs)} |")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile written by `dynaplane calibrate`")
    parser.add_argument("layout", help="a layout of the validation, e.g. tp=1,pp=2,dp=1,zero=1")
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32, help="as the validation's on a CPU without native bf16")
    args = parser.parse_args()
    main(args.profile, args.layout, args.global_batch, args.seq)
