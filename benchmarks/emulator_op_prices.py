"""Each op of a step's backwards and optimizer, its real seconds against the emulator's price of the very same op.

    .venv/bin/python -m benchmarks.emulator_op_prices var/cpu-profile.json tp=1,pp=2,dp=1,zero=1

Runs the validation's program (llama-124m on 2 local ranks). Inside every backward of a
few steps (a pipeline's `PipelineStage.backward_one_chunk`, else `Tensor.backward`) and
every optimizer step, the tracer's own recorder (OpRecorder)
records the ops the rank really runs, on real tensors, and this times each one. Each record
is then priced as the emulator prices a traced op (`costs.compute_seconds` on the same
ComputeOp that trace_build makes of it), so both sides hold the same op list and no
alignment is guessed. Prints, per rank and section, its wall time, its ops' real and
priced sums, and a table by op name sorted by how far the price is off.

Why: the validation's pipeline rows are predicted 7-11% fast and the timeline
(benchmarks.emulator_timeline) put it on each stage's steady-state backward. The recorder
adds Python work between ops (not inside the timed call), so wall time here is longer
than in a plain step; the op sums are what to compare.
"""
from __future__ import annotations

import statistics
import time

from benchmarks.emulator_validation import MICRO_BATCH, MODEL, WORLD


class _TimedCall:
    """An OpOverload that remembers how long its last call took (the rest passes through)."""

    def __init__(self, func):
        self.func = func
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.func(*args, **kwargs)
        finally:
            self.seconds = time.perf_counter() - started

    def __getattr__(self, name):
        return getattr(self.func, name)


def timed_recorder():
    """An OpRecorder whose `seconds[i]` is the wall time of `records[i]`'s call."""
    from parallelism.emulator.recorder import OpRecorder

    class TimedRecorder(OpRecorder):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.seconds: list[float] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            call = _TimedCall(func)
            before = len(self.records)
            out = super().__torch_dispatch__(call, types, args, kwargs)
            self.seconds += [call.seconds] * (len(self.records) - before)
            return out

    return TimedRecorder()


class _CurrentRecorder:
    """Stands for whichever section's recorder is active, for trace_accumulation.tag_accumulation
    (which sets `role` on the recorder it was given)."""

    recorder = None

    @property
    def role(self) -> str:
        return self.recorder.role if self.recorder is not None else ""

    @role.setter
    def role(self, value: str) -> None:
        if self.recorder is not None:
            self.recorder.role = value


def recorded_rank(rank: int, world: int, layout: str, global_batch: int, seq: int, warmup: int = 2,
                  steps: int = 5) -> dict:
    """Every backward (a pipeline's `backward_one_chunk`, else `Tensor.backward`) and the
    optimizer step of `steps` steps: {"names": each section's name ("backward 1", ...,
    "optimizer"), "records": each section's compute records (the same every step),
    "seconds": [step][section][op] real seconds, "wall": [step][section]}."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from parallelism.emulator.real_steps import prepared_trainer
    from parallelism.emulator.recorder import ComputeRecord
    from parallelism.emulator.trace_accumulation import tag_accumulation
    from parallelism.layout.spec import parse_layout

    sections: list[tuple[str, list, list, float]] = []
    current = _CurrentRecorder()

    def recorded(method, kind: str):
        def run(*args, **kwargs):
            recorder = current.recorder = timed_recorder()
            started = time.perf_counter()
            with recorder:
                out = method(*args, **kwargs)
            wall = time.perf_counter() - started
            kept = [(r, s) for r, s in zip(recorder.records, recorder.seconds) if isinstance(r, ComputeRecord)]
            same = sum(1 for name, *_ in sections if name.startswith(kind))
            name = f"{kind} {same + 1}" if kind == "backward" else kind
            sections.append((name, [r for r, _ in kept], [s for _, s in kept], wall))
            return out
        return run

    pipelined = max(m.pp for m in parse_layout(layout).modules) > 1
    owner, attribute = (PipelineStage, "backward_one_chunk") if pipelined else (torch.Tensor, "backward")
    original = getattr(owner, attribute)
    setattr(owner, attribute, recorded(original, "backward"))
    result: dict = {"names": [], "records": [], "seconds": [], "wall": []}
    try:
        trainer, _ = prepared_trainer(MODEL, layout, rank, global_batch, MICRO_BATCH, seq, warmup + steps + 1)
        trainer.optimizer.step = recorded(trainer.optimizer.step, "optimizer")
        tag_accumulation(trainer.optimizer, current)  # the roles the trace gives (priced by them)
        for n in range(warmup + steps):
            dist.barrier()
            sections.clear()
            trainer.step()
            if n < warmup:
                continue
            result["names"] = [name for name, *_ in sections]
            result["records"] = [records for _, records, _, _ in sections]
            result["seconds"].append([seconds for _, _, seconds, _ in sections])
            result["wall"].append([wall for *_, wall in sections])
    finally:
        setattr(owner, attribute, original)
    return result


def priced(records, profile) -> list[float]:
    """The emulator's seconds for each recorded op, as trace_build and costs make them."""
    from parallelism.emulator.costs import compute_seconds
    from parallelism.emulator.trace_build import compute_op

    return [compute_seconds(compute_op(r), profile) for r in records]


def by_name(names: list[str], real: list[float], price: list[float]) -> list[tuple[str, int, float, float]]:
    """(name, count, real seconds, priced seconds) per op name, the largest |priced - real| first. Pure."""
    sums: dict[str, list] = {}
    for name, r, p in zip(names, real, price, strict=True):
        row = sums.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += r
        row[2] += p
    rows = [(name, n, r, p) for name, (n, r, p) in sums.items()]
    return sorted(rows, key=lambda row: -abs(row[3] - row[2]))


def median_per_op(steps: list[list[float]]) -> list[float]:
    """Each op's median over steps (steps[k][i]: op i's seconds in step k). Pure."""
    return [statistics.median(column) for column in zip(*steps, strict=True)]


def main(profile_path: str, layout: str, global_batch: int, seq: int, top: int, op: str = "") -> None:
    from parallelism.emulator.devices import load_profile
    from parallelism.engine.launch import run_ranks

    profile = load_profile(profile_path)
    for rank, result in enumerate(run_ranks(WORLD, recorded_rank, layout, global_batch, seq, timeout_s=1800)):
        for n, (section, records) in enumerate(zip(result["names"], result["records"])):
            real = median_per_op([step[n] for step in result["seconds"]])
            price = priced(records, profile)
            wall = statistics.median(step[n] for step in result["wall"])
            print(f"\nrank {rank} {section}: wall {wall * 1e3:.1f} ms (recorded), {len(records)} ops: "
                  f"real {sum(real) * 1e3:.1f} ms, priced {sum(price) * 1e3:.1f} ms "
                  f"({sum(price) / max(sum(real), 1e-12) - 1:+.1%})")
            print("| op | count | real ms | priced ms | priced - real ms |")
            print("|---|---|---|---|---|")
            for name, count, r, p in by_name([x.name for x in records], real, price)[:top]:
                print(f"| {name} | {count} | {r * 1e3:.2f} | {p * 1e3:.2f} | {(p - r) * 1e3:+.2f} |")
            if op:
                print(f"\nevery {op}: | shape | form | dtype | source | role | MB | real ms | priced ms |")
                for x, r, p in zip(records, real, price):
                    if x.name == op:
                        print(f"| {x.shape} | {x.form} | {x.dtype} | {x.source} | {x.role} | {x.bytes / 1e6:.1f} | "
                              f"{r * 1e3:.3f} | {p * 1e3:.3f} |")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile written by `dynaplane calibrate`")
    parser.add_argument("layout", help="a layout of the validation, e.g. tp=1,pp=2,dp=1,zero=1")
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32, help="as the validation's on a CPU without native bf16")
    parser.add_argument("--top", type=int, default=12, help="op names to list per backward")
    parser.add_argument("--op", default="", help="also list every op of this name (shape, bytes, real, priced)")
    args = parser.parse_args()
    main(args.profile, args.layout, args.global_batch, args.seq, args.top, args.op)
