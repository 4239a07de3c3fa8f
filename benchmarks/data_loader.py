"""The data loader against the trainer: tokens per second one rank's loader produces (its slice of
each global batch read from the memmapped dataset through the sample order, plus the digest of
what it read) against the tokens per second one rank of a real training step consumes, in the same
process. Also the longest single batch (a stall would show there) and the first batch of a new
epoch, with the epoch index prefetched (what training does) and built cold (what it would cost).

    .venv/bin/python -m benchmarks.data_loader [--dataset DIR]
"""
from __future__ import annotations

import argparse
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path


def _stdlib(tmp: str) -> str:
    from parallelism.datasets.prepare import prepare

    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts)
    return str(prepare(files, Path(tmp) / "python-stdlib", progress=False).directory)


def loader_rate(dataset: str, seq: int, per_rank: int, steps: int, dp: int = 4) -> tuple[float, float]:
    """(tokens/s, slowest batch in s) of one rank reading its slice of `steps` global batches."""
    from parallelism.datasets.dataset import TokenDataset
    from parallelism.training.data import sample_digest

    data = TokenDataset(dataset, seq, seed=1)
    data.batch(0, per_rank)  # epoch 0 built (training builds it before the first step)
    worst, started = 0.0, time.perf_counter()
    for step in range(steps):
        first = step * per_rank * dp + per_rank  # dp rank 1 of dp
        t = time.perf_counter()
        data.batch(first, per_rank)
        sample_digest(data, first, per_rank)
        worst = max(worst, time.perf_counter() - t)
    return steps * per_rank * seq / (time.perf_counter() - started), worst


def epoch_boundary(dataset: str, seq: int, per_rank: int) -> tuple[float, float]:
    """(first batch of epoch 1 after reading through epoch 0, the same with a cold index), seconds."""
    from parallelism.datasets.dataset import CACHE_DIR, TokenDataset

    shutil.rmtree(Path(dataset) / CACHE_DIR, ignore_errors=True)
    data = TokenDataset(dataset, seq, seed=2)
    S = data.samples_per_epoch
    data.batch(S - 2 * per_rank, per_rank)  # late in epoch 0: epoch 1 is prefetched
    time.sleep(0.5 + S / 2e6)  # a step's worth of time for the background build
    t = time.perf_counter()
    data.batch(S, per_rank)
    warm = time.perf_counter() - t
    shutil.rmtree(Path(dataset) / CACHE_DIR, ignore_errors=True)
    cold = TokenDataset(dataset, seq, seed=3, cache=False)
    cold.parts[0].prefetch = lambda e: None  # what the boundary would cost without prefetching
    cold.batch(0, 1)
    t = time.perf_counter()
    cold.batch(S, per_rank)
    return warm, time.perf_counter() - t


def trainer_rate(dataset: str, seq: int, per_rank: int, steps: int = 4) -> float:
    """Tokens/s one rank consumes: a real tiny-gpt step (dp=1) with the loader inside it."""
    from parallelism.engine.launch import run_ranks

    seconds = run_ranks(1, _steps, dataset, seq, per_rank, steps, timeout_s=600)[0]
    return per_rank * seq / min(seconds)


def _steps(rank, world, dataset, seq, per_rank, steps):
    from parallelism.layout.placement import place
    from parallelism.training.parallel import ParallelTrainer, TrainConfig, initial_shards

    config = TrainConfig(model="tiny-gpt", global_batch=per_rank, seq_len=seq, micro_batches=1, dataset=dataset)
    placement = place(config.tensors, "dp=1")
    trainer = ParallelTrainer(config, "dp=1", 0, initial_shards(placement, 0, 0))
    return [trainer.step().seconds for _ in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=None, help="default: the stdlib prepared into a temporary directory")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dataset = args.dataset or _stdlib(tmp)
        print(f"dataset {dataset}")
        for seq, per_rank in [(128, 8), (4096, 8)]:
            loader, worst = loader_rate(dataset, seq, per_rank, args.steps)
            trainer = trainer_rate(dataset, seq, per_rank)
            print(f"seq {seq}, {per_rank} samples a rank: loader {loader:,.0f} tokens/s, slowest batch "
                  f"{worst * 1e3:.2f} ms; tiny-gpt step on this CPU {trainer:,.0f} tokens/s; "
                  f"headroom {loader / trainer:,.0f}x")
        warm, cold = epoch_boundary(dataset, 128, 8)
        print(f"first batch of a new epoch (seq 128): {warm * 1e3:.2f} ms with the index prefetched, "
              f"{cold * 1e3:.1f} ms built cold")


if __name__ == "__main__":
    main()
