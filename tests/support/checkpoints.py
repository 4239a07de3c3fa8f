"""Real checkpoints for control-plane tests, written by rank processes (run_ranks) with the
agents' own Checkpointer (agents/runtime/checkpoints.py). No Django here: run_ranks' processes
import this module by name."""
from __future__ import annotations

import os


def train_and_checkpoint(rank: int, world: int, root: str, model: str, layout: str, steps: int) -> bytes:
    """`steps` training steps of `model` (a catalog name, or a Hugging Face directory loaded with
    hf_initial_shards), then the checkpoint of that step under `root` (step-<N>-0, complete.json
    last); this rank's master shards after the save (the oracle), packed."""
    from agents.runtime.checkpoints import Checkpointer
    from parallelism.hf_weights import hf_initial_shards
    from parallelism.layout.placement import place
    from parallelism.training.parallel import ParallelTrainer, TrainConfig, initial_shards
    from tests.parallelism.hf_weights.tiny_hf import pack

    config = TrainConfig(model=model, global_batch=4, seq_len=16, micro_batches=2, lr=1e-2)
    placement = place(config.tensors, layout)
    shards = hf_initial_shards(placement, rank, model) if os.path.isdir(model) else initial_shards(placement, rank, 0)
    trainer = ParallelTrainer(config, layout, rank, shards)
    for _ in range(steps):
        trainer.step()
    checkpointer = Checkpointer(1, root, rank)
    checkpointer.prepare(trainer.placement, force=True)
    trainer, _, _ = checkpointer.save(trainer, config)
    shards, _ = trainer.hand_over()
    return pack([s for s in shards.values() if s.state == "master"])


def load_and_checkpoint(rank: int, world: int, root: str, hf_dir: str) -> bytes:
    """The Hugging Face directory loaded on one rank and checkpointed untrained (step-00000000-0)."""
    return train_and_checkpoint(rank, world, root, hf_dir, "tp=1,pp=1,dp=1,zero=0", 0)
