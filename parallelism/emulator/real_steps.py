"""Time real training steps of the program the emulator traces, on this machine's ranks.

Used twice: `calibrate` times a tiny model's steps to measure the per-op host cost of the
real program (Python, module hooks, autograd, the optimizer loop, DTensor's dispatch), and
the CPU validation benchmark times the validated model's steps to compare with
`emulate`. Runs inside a rank of an initialized process group.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RealSteps:
    seconds: float       # median step time, the slowest rank's (a step ends on every rank together)
    static_bytes: int    # parameters, gradients and optimizer state held by this rank
    peak_bytes: int      # parameters + optimizer state + live tensor bytes of one step
    fastest: float = 0.0  # the fastest measured step (the machine at its quietest)
    all_seconds: tuple[float, ...] = ()  # every measured step, in order


def prepared_trainer(model: str, layout: str, rank: int, global_batch: int, micro_batch: int, seq: int,
                     steps: int, device=None):
    """ParallelTrainer for `layout` with the batches of its first `steps` steps made ahead:
    the emulator predicts the training step, not the data pipeline. `device`: where the
    rank's state and batches live (a GPU under an NCCL group; default the CPU)."""
    from parallelism.layout.catalog import get_model
    from parallelism.layout.placement import place
    from parallelism.training.parallel import ParallelTrainer, TrainConfig, initial_shards

    placement = place(get_model(model), layout)
    ml = next(iter(placement.modules.values()))
    config = TrainConfig(model=model, global_batch=global_batch, seq_len=seq,
                         micro_batches=global_batch // (micro_batch * ml.dp))
    shards = initial_shards(placement, rank, config.seed)
    if device is not None:
        shards = {key: dataclasses.replace(shard, data=shard.data.to(device)) for key, shard in shards.items()}
    trainer = ParallelTrainer(config, layout, rank, shards)
    made = {}
    real_batch = trainer.data.batch
    share = global_batch // ml.dp
    for step in range(steps):
        for d in range(ml.dp):
            position = step * global_batch + d * share
            made[(position, share)] = tuple(t.to(device) if device is not None else t
                                            for t in real_batch(position, share))
    trainer.data.batch = lambda position, n: made[(position, n)]
    return trainer, ml.zero


def time_steps(model: str, layout: str, rank: int, global_batch: int, micro_batch: int, seq: int,
               warmup: int = 2, measured: int = 4) -> RealSteps:
    """Time `measured` steps of `layout` after `warmup` (prepared_trainer)."""
    import torch
    import torch.distributed as dist

    from parallelism.emulator.recorder import OpRecorder
    from parallelism.emulator.trace_build import trainer_static_bytes

    trainer, zero = prepared_trainer(model, layout, rank, global_batch, micro_batch, seq, warmup + measured + 1)
    state = trainer_static_bytes(trainer, zero)
    times = []
    for step in range(warmup + measured):
        dist.barrier()
        started = time.perf_counter()
        trainer.step()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(float(elapsed))
    recorder = OpRecorder()
    with recorder:  # gradients are allocated during the step, so the recorder counts them
        trainer.step()
    return RealSteps(statistics.median(times), sum(state.values()),
                     state["params"] + state["optimizer"] + recorder.peak, min(times), tuple(times))


def time_device_steps(rank: int, world: int, model: str, seq: int, micro_batch: int, micro_batches: int = 1,
                      kind: str = "cuda", warmup: int = 2, measured: int = 5) -> dict:
    """One rank's ParallelTrainer for tp=1,pp=1,dp=1 (run as launch.run_ranks' fn in a
    one-rank world: NCCL for kind "cuda", its state in bf16 with fp32 AdamW masters and
    moments on cuda:0; gloo on a CPU): {"seconds": median step, "all_seconds",
    "peak_bytes": the device allocator's peak over the measured steps (a CPU: the
    parameters, optimizer state and one step's live tensors, as time_steps counts them)}.
    Each step ends on the host reading the loss (trainer.step's .item()), so the wall
    clock around it is the device's time too; synchronized before each start."""
    import torch

    from parallelism.emulator.recorder import OpRecorder
    from parallelism.emulator.trace_build import trainer_static_bytes

    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    trainer, zero = prepared_trainer(model, "tp=1,pp=1,dp=1", rank, micro_batch * micro_batches, micro_batch, seq,
                                     warmup + measured + 1, device)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    times = []
    for step in range(warmup + measured):
        if step == warmup and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        synchronize()
        started = time.perf_counter()
        trainer.step()
        synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:
        state = trainer_static_bytes(trainer, zero)
        recorder = OpRecorder()
        with recorder:
            trainer.step()
        peak = state["params"] + state["optimizer"] + recorder.peak
    return {"seconds": statistics.median(times), "all_seconds": times, "peak_bytes": int(peak),
            "device": str(device), "world": world}
