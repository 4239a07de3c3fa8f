"""Periodic checkpoints of a running job, and the restore of a new world from one.

A checkpoint is the job's whole training state at a step boundary: every rank's boxes of
params, fp32 masters and Adam moments, written with torch.distributed.checkpoint through
parallelism/engine/checkpoint.py (the DTensor view of our shards the checkpoint-restart
baseline uses), plus the scalars (step, which is also the LR schedule's position, data
position, RNG state) and the state's digests. Layout: `<checkpoint_dir>/step-00000040-0/`
(step, then the restore the writing world came from, 0 for the first: a world restarted
from step 30 that reaches step 40 again never touches the first world's folder, which the
control plane may be restoring from) holds DCP's files, `scalars.pt` and, written last by
rank 0, `complete.json`; a folder without `complete.json` is not a checkpoint. Only the
last KEEP complete ones are kept.

DCP reshards on load, so a world of another layout (fewer GPUs after a node loss) loads
the same folder; the digests, which do not depend on the layout, prove the loaded state
bit-equal to the saved one.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from agents import protocol
from parallelism.layout.tensors import Model

COMPLETE = protocol.CHECKPOINT_COMPLETE_MARKER
SCALARS = "scalars.pt"
KEEP = 3


def step_dir(root: str | Path, step: int, world: int = 0) -> Path:
    return Path(root) / f"step-{step:08d}-{world}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / COMPLETE).exists())


def prune(root: str | Path, keep: int = KEEP) -> None:
    """Drop all but the last `keep` complete checkpoints (and older unfinished folders)."""
    done = complete_checkpoints(root)
    if not done:
        return
    kept = {p.name for p in done[-keep:]}
    for path in Path(root).glob("step-*"):
        if path.name not in kept and path.name < done[-1].name:
            shutil.rmtree(path, ignore_errors=True)


def _digest_rows(digests: dict) -> list[list]:
    return [[index, state, value] for (index, state), value in sorted(digests.items())]


class Checkpointer:
    """One rank's side of periodic checkpoints. `prepare` is collective (it builds the
    DTensor meshes, which creates process groups over the default group): call it where
    every rank of the default group builds its trainer, so later saves need no new group."""

    def __init__(self, interval: int, root: str, rank: int, world: int = 0) -> None:
        if interval and not root:
            raise ValueError(f"checkpoint_interval={interval} needs a checkpoint_dir")
        self.interval, self.root, self.rank, self.world = interval, root, rank, world
        self.meshes: dict | None = None

    def prepare(self, placement, *, force: bool = False) -> None:
        from parallelism.engine.checkpoint import layout_meshes

        self.meshes = layout_meshes(placement) if (self.interval or force) else None

    def due(self, step: int) -> bool:
        return bool(self.interval) and step > 0 and step % self.interval == 0

    def save(self, trainer, config):
        """Write the checkpoint of the trainer's current step; returns (trainer, path,
        seconds). The trainer hands its state over and is rebuilt from it on the same
        meshes (the exact path a rolled-back switch takes), so training goes on bit-equal."""
        import torch
        import torch.distributed.checkpoint as dcp

        from parallelism.engine.checkpoint import to_dtensors
        from parallelism.engine.digest import state_digests
        from parallelism.training.run import build_trainer

        started = time.perf_counter()
        placement, meshes, layout = trainer.placement, trainer.meshes, str(trainer.placement.layout)
        shards, scalars = trainer.hand_over()
        del trainer
        path = step_dir(self.root, scalars.step, self.world)
        if self.rank == 0:  # (a half-written folder of this step goes first)
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        digests = state_digests(placement, self.rank, shards, group=meshes.everyone)  # (also: rank 0 is done)
        path.mkdir(parents=True, exist_ok=True)
        dcp.save(to_dtensors(placement, self.rank, shards, self.meshes), checkpoint_id=str(path),
                 process_group=meshes.everyone)
        if self.rank == 0:
            torch.save({"step": scalars.step, "samples": scalars.data.samples, "rng": scalars.rng}, path / SCALARS)
            (path / COMPLETE).write_text(json.dumps({
                "step": scalars.step, "layout": layout, "model": placement.model.name,
                "digests": _digest_rows(digests), "saved_at": time.time()}))
            prune(self.root)
        trainer = build_trainer(config, layout, self.rank, shards, scalars, meshes=meshes)
        return trainer, path, time.perf_counter() - started


def restore(model: Model, layout: str, rank: int, path: str | Path, meshes: dict):
    """This rank's shards of `layout` loaded from the checkpoint at `path` (every rank of
    the new world calls it), the scalars, and whether the loaded state's digests equal the
    saved ones. Raises FileNotFoundError naming the folder when it is not a complete checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    from parallelism.engine.checkpoint import to_dtensors
    from parallelism.engine.digest import state_digests
    from parallelism.engine.shards import empty_shard, rank_boxes
    from parallelism.layout.placement import place
    from parallelism.training.data import DataPosition
    from parallelism.training.parallel import TrainScalars

    path = Path(path)
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE})")
    meta = json.loads((path / COMPLETE).read_text())
    placement = place(model, layout)
    boxes = rank_boxes(placement, rank) if rank < placement.world else {}
    shards = {key: empty_shard(placement.model.tensors[key[0]], key[1], box) for key, box in boxes.items()}
    dcp.load(to_dtensors(placement, rank, shards, meshes), checkpoint_id=str(path))
    saved = torch.load(path / SCALARS, weights_only=False)
    scalars = TrainScalars(step=saved["step"], data=DataPosition(saved["samples"]), rng=saved["rng"])
    torch.set_rng_state(scalars.rng)
    verified = _digest_rows(state_digests(placement, rank, shards)) == meta["digests"]
    return shards, scalars, verified
