"""Time real training steps of the program the emulator traces, on this machine's ranks.

Used twice: `calibrate` times a tiny model's steps to measure the per-op host cost of the
real program (Python, module hooks, autograd, the optimizer loop, DTensor's dispatch), and
the CPU validation benchmark times the validated model's steps to compare with
`emulate`. Runs inside a rank of an initialized process group.
"""
from __future__ import annotations

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
                     steps: int):
    """ParallelTrainer for `layout` with the batches of its first `steps` steps made ahead:
    the emulator predicts the training step, not the data pipeline."""
    from parallelism.layout.catalog import get_model
    from parallelism.layout.placement import place
    from parallelism.training.parallel import ParallelTrainer, TrainConfig, initial_shards

    placement = place(get_model(model), layout)
    ml = next(iter(placement.modules.values()))
    config = TrainConfig(model=model, global_batch=global_batch, seq_len=seq,
                         micro_batches=global_batch // (micro_batch * ml.dp))
    trainer = ParallelTrainer(config, layout, rank, initial_shards(placement, rank, config.seed))
    made = {}
    real_batch = trainer.data.batch
    share = global_batch // ml.dp
    for step in range(steps):
        for d in range(ml.dp):
            position = step * global_batch + d * share
            made[(position, share)] = real_batch(position, share)
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
