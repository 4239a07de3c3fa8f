"""Whole logical tensors from shards: assembled from every rank's LocalShards in one process,
or read (fp32 masters) from one of the project's DCP checkpoints, resharded by DCP."""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from parallelism.engine.shards import LocalShard
from parallelism.hf_weights.errors import HFWeightsError
from parallelism.layout.shards import b_dim
from parallelism.layout.tensors import Model


def assemble(model: Model, shards: Iterable[LocalShard], state: str = "master") -> dict[str, Tensor]:
    """Every tensor of `model`, whole, from the `state` boxes of `shards` (all ranks' shards of a
    layout, e.g. returned by run_ranks); replicas overwrite each other with their equal values.
    HFWeightsError names a tensor some element of which no shard covers."""
    out: dict[str, Tensor] = {}
    covered: dict[str, Tensor] = {}
    for shard in shards:
        if shard.state != state:
            continue
        name = shard.tensor.name
        if name not in out:
            out[name] = torch.empty(shard.tensor.shape, dtype=shard.data.dtype)
            covered[name] = torch.zeros(shard.tensor.shape, dtype=torch.bool)
        bd = b_dim(shard.tensor)
        whole = (0, shard.tensor.shape[0], 0, shard.tensor.shape[bd] if bd is not None else 0)
        LocalShard(shard.tensor, state, whole, out[name]).region(shard.box).copy_(shard.data)
        LocalShard(shard.tensor, state, whole, covered[name]).region(shard.box).fill_(True)
    for t in model.tensors:
        if t.name not in out or not bool(covered[t.name].all()):
            raise HFWeightsError(f"{t.name}: the {state} shards do not cover the whole tensor")
    return out


def check_checkpoint(checkpoint_dir: str, model: Model) -> None:
    """The DCP checkpoint at `checkpoint_dir` holds every tensor's fp32 master with the model's shape."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        raise HFWeightsError(f"{checkpoint_dir}: not a DCP checkpoint (no .metadata)")
    meta = FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    for t in model.tensors:
        key = f"{t.name}/master"
        entry = meta.get(key)
        if entry is None:
            raise HFWeightsError(f"{checkpoint_dir}: no {key} (a checkpoint of another model than {model.name!r}?)")
        size = tuple(getattr(entry, "size", ()))
        if size != t.shape:
            raise HFWeightsError(f"{checkpoint_dir}: {key} has shape {size}, {model.name!r} {t.shape}")


def read_checkpoint_masters(checkpoint_dir: str, model: Model, names: Sequence[str]) -> dict[str, Tensor]:
    """The fp32 masters of `names`, whole, read from the checkpoint in this process alone
    (dcp.load with no_dist: DCP reshards the saved boxes into whole tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    specs = {t.name: t for t in model.tensors}
    state = {f"{n}/master": torch.empty(specs[n].shape, dtype=torch.float32) for n in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(checkpoint_dir), no_dist=True)
    return {n: state[f"{n}/master"] for n in names}
