"""Does the demo learn real text? tiny-gpt trained with the demo job's settings (tp=2, global
batch 8, micro-batch 1, seq 128, the product's LR schedule) on the Python standard library's own
source, byte-level; its validation loss after N steps against the unigram baseline of the corpus:
the cross-entropy of the same held-out targets under the training split's byte frequencies (add-one
smoothed). Bits per byte = nats per token / ln 2 (byte-level: one token per byte, plus one
end-of-document token per file).

    .venv/bin/python -m benchmarks.demo_learning --steps 200 [--dataset DIR]
"""
from __future__ import annotations

import argparse
import math
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np


def unigram_bits(dataset: str, seq: int, seed: int, samples: int) -> float:
    """Bits per token of the validation samples' targets under the train split's unigram model."""
    from parallelism.datasets.dataset import TokenDataset

    train = TokenDataset(dataset, seq, seed).parts[0]
    counts = np.ones(train.manifest.vocab_size, dtype=np.float64)
    for d in train.ids:
        start, length = int(train.doc_starts[d]), int(train.doc_lengths[d])
        counts += np.bincount(np.asarray(train.view[start:start + length]), minlength=len(counts))
    logp = np.log2(counts / counts.sum())
    held = TokenDataset(dataset, seq, seed, split="validation")
    targets = np.concatenate([held.sample(i)[1:] for i in range(samples)])
    return float(-logp[targets].mean())


def _rank(rank, world, config, layout, steps, eval_every, eval_batches):
    from parallelism.training.run import train_rank

    log = train_rank(rank, world, config, layout, steps, [], eval_every=eval_every, eval_batches=eval_batches)
    return [(e.step, e.loss) for e in log.evals], [s.loss for s in log.steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--dataset", default=None, help="default: the stdlib prepared into a temporary directory")
    args = parser.parse_args()
    from agents.runtime.job_settings import SCHEDULE_STEPS
    from parallelism.datasets.prepare import prepare
    from parallelism.engine.launch import run_ranks
    from parallelism.training.parallel import TrainConfig

    with tempfile.TemporaryDirectory() as tmp:
        dataset = args.dataset
        if dataset is None:
            lib = Path(sysconfig.get_paths()["stdlib"])
            files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts)
            result = prepare(files, Path(tmp) / "python-stdlib", progress=False)
            dataset = str(result.directory)
            print(f"prepared the stdlib: {result.documents} files, {result.tokens:,} tokens in {result.seconds:.1f} s")
        seq, batch = 128, 8
        config = TrainConfig(model="tiny-gpt", global_batch=batch, seq_len=seq, micro_batches=batch,
                             dataset=dataset, total_steps=SCHEDULE_STEPS)
        baseline = unigram_bits(dataset, seq, config.seed, args.eval_batches * batch)
        started = time.perf_counter()
        evals, losses = run_ranks(2, _rank, config, "tp=2", args.steps, args.eval_every, args.eval_batches,
                                  timeout_s=3600)[0]
        seconds = time.perf_counter() - started
    print(f"tiny-gpt, tp=2, global batch {batch}, seq {seq}: {args.steps} steps in {seconds:.0f} s")
    print(f"train loss: first {losses[0]:.3f}, last {losses[-1]:.3f} nats/token")
    print(f"unigram baseline on the same held-out targets: {baseline:.3f} bits per byte")
    for step, loss in evals:
        bits = loss / math.log(2)
        print(f"validation after step {step:4d}: {bits:.3f} bits per byte ({bits / baseline:.3f} x unigram)")
    final = evals[-1][1] / math.log(2)
    print(f"RESULT: {'below' if final < baseline else 'NOT below'} the unigram baseline after {evals[-1][0]} "
          f"steps: {final:.3f} against {baseline:.3f} bits per byte")


if __name__ == "__main__":
    main()
