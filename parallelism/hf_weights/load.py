"""Load a Hugging Face checkpoint into a rank's local shards: `hf_initial_shards` has
`initial_shards`' contract (parallelism/training/parallel.py): for every (tensor, state) box
the rank holds, master = the fp32 value, param = its bf16 cast, Adam moments zero.

Every check that needs no tensor data runs first, on every rank: config.json (model_type,
settings the trainer computes differently), the placement's model against config.json,
then the index and every shard file's header (names, shapes, dtypes) against the
adapter's map. Then each rank reads only its boxes.

Why region reads of our own (region_read.py) and not torch's HuggingFaceStorageReader
(torch 2.13): the reader does read only a box (with safetensors' get_slice), but a box of an
HF tensor, in HF's name, shape and dim order, requested by `dcp.load` for a DTensor (or a
whole tensor) keyed by the HF name. Our boxes are boxes of *our* tensors: a per-expert
checkpoint's experts are E HF tensors stacked into one of ours, GPT-2's q/k/v are column
ranges of the fused, transposed c_attn (a ZeRO chunk of q is a column range of it), a
fused gate_up_proj holds two of ours. Those boxes are no DTensor shard of an HF tensor (a
stack of E tensors, a transposed column range), so the reader would load whole HF tensors
to copy boxes out of; a region read takes exactly each box's rows, per rank, no collective.
The reader also lists every *.safetensors file in the folder instead of following
model.safetensors.index.json, so a missing shard would surface as a missing tensor, and a
stray file would be read. And get_slice reads through a memory map, whose page faults on a
cold file cost four times the CPU of large reads (region_read.py).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor

from parallelism.engine.shards import DTYPES, Box, Key, LocalShard, rank_boxes
from parallelism.engine.zero_pages import untouched_zeros
from parallelism.hf_weights.config_rules import check_computable
from parallelism.hf_weights.convert import read_box
from parallelism.hf_weights.errors import HFWeightsError
from parallelism.hf_weights.families import detect_variant, hf_map
from parallelism.hf_weights.hf_files import CONFIG, HFDir, check_tensors, read_hf_dir, read_json
from parallelism.hf_weights.pieces import HFMap, Range
from parallelism.hf_weights.region_read import SafetensorsFile
from parallelism.layout.catalog import model_from_config
from parallelism.layout.errors import LayoutError
from parallelism.layout.hf_config import SUPPORTED_TYPES, WEIGHT_TYPES, load_hf_config
from parallelism.layout.model_config import ModelConfig
from parallelism.layout.placement import Placement
from parallelism.layout.shards import b_dim
from parallelism.layout.tensors import Model, TensorSpec


@dataclass(frozen=True)
class HFSource:
    """A checked Hugging Face model directory: its files, its config and the adapter's map."""

    dir: HFDir
    config: ModelConfig
    hfmap: HFMap

    @property
    def model(self) -> Model:
        return model_from_config(self.config)


def hf_model_config(hf_dir: str) -> ModelConfig:
    """The ModelConfig of `hf_dir`/config.json; HFWeightsError for an unsupported model_type or a bad config."""
    path = os.path.join(hf_dir, CONFIG)
    raw = read_json(path)
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in WEIGHT_TYPES:
        read_only = ": read as a model (to train from scratch, to emulate), its weights have no adapter" \
            if model_type in SUPPORTED_TYPES else ""
        raise HFWeightsError(f"{path}: unsupported model_type {model_type!r}{read_only} (supported: "
                             f"{', '.join(WEIGHT_TYPES)})")
    try:
        return load_hf_config(path)
    except LayoutError as exc:
        raise HFWeightsError(str(exc)) from None


def open_hf_source(hf_dir: str, model: Model | None = None) -> HFSource:
    """Every header-level check of `hf_dir` (and, given `model`, that it is config.json's model);
    reads no tensor data."""
    config = hf_model_config(hf_dir)
    config_path = os.path.join(hf_dir, CONFIG)
    if model is not None:
        check_same_model(model, model_from_config(config), config_path)
    hf = read_hf_dir(hf_dir)
    check_computable(hf.raw_config, config, config_path)
    hfmap = hf_map(config.llm, hf.model_type, detect_variant(hf.model_type, list(hf.files)))
    check_tensors(hf, hfmap)
    return HFSource(hf, config, hfmap)


def check_same_model(model: Model, expected: Model, config_path: str) -> None:
    """`model` (a placement's) has the tensors, names and shapes, of config.json's model."""
    ours = [(t.name, t.shape) for t in model.tensors]
    theirs = [(t.name, t.shape) for t in expected.tensors]
    if ours == theirs:
        return
    for (name, _), (other, _) in zip(ours, theirs):
        if name != other:
            raise HFWeightsError(f"{config_path}: describes another model than {model.name!r}: its tensor {other!r} "
                                 f"stands where {model.name!r} has {name!r}")
    if len(ours) != len(theirs):
        raise HFWeightsError(f"{config_path}: describes another model than {model.name!r}: {len(theirs)} tensors, "
                             f"{model.name!r} has {len(ours)}")
    for (name, shape), (_, other_shape) in zip(ours, theirs):
        if shape != other_shape:
            if name in ("llm.embed.weight", "llm.head.weight") and shape[1:] == other_shape[1:]:
                side = "larger" if other_shape[0] > shape[0] else "smaller"
                raise HFWeightsError(f"{config_path}: vocab_size {other_shape[0]}, but {model.name!r} has a vocabulary "
                                     f"of {shape[0]}: the checkpoint's vocabulary is {side}")
            raise HFWeightsError(f"{config_path}: {name} has shape {other_shape} there, {shape} in {model.name!r}")


def box_ranges(tensor: TensorSpec, box: Box) -> tuple[Range, ...]:
    """A box (parallelism/engine/shards.py) as one [start, stop) per dim."""
    ranges = [(0, n) for n in tensor.shape]
    ranges[0] = (box[0], box[1])
    bd = b_dim(tensor)
    if bd is not None:
        ranges[bd] = (box[2], box[3])
    return tuple(ranges)


class RegionFiles:
    """Open safetensors files (each once) and read regions of their tensors, each into a
    tensor of its own, with large positional reads of the region's rows (region_read.py)."""

    def __init__(self, hf: HFDir, stack: ExitStack) -> None:
        self.hf, self.stack, self.handles = hf, stack, {}
        self.scratch: list[Tensor] = []

    def read(self, hf_name: str, slices: tuple[slice, ...]) -> Tensor:
        file = self.hf.file_of(hf_name)
        if file not in self.handles:
            handle = self.handles[file] = SafetensorsFile(file)
            self.stack.callback(handle.close)
        return self.handles[file].region(hf_name, [(s.start, s.stop) for s in slices], self.scratch)


def hf_initial_shards(placement: Placement, rank: int, hf_dir: str) -> dict[Key, LocalShard]:
    """This rank's boxes of the Hugging Face checkpoint in `hf_dir` (a directory with config.json
    and model.safetensors or model.safetensors.index.json + shards): master = the fp32 value,
    param = its bf16 cast, Adam moments zero, as `initial_shards` makes them. The placement's
    model must be config.json's (build it with TrainConfig(model=hf_dir) or get_model(hf_dir)).
    Raises HFWeightsError (a ValueError) before reading any tensor data when a check fails."""
    source = open_hf_source(hf_dir, placement.model)
    return read_shards(source, placement, rank)


def read_shards(source: HFSource, placement: Placement, rank: int) -> dict[Key, LocalShard]:
    """The rank's boxes read out of a checked source (open_hf_source)."""
    by_tensor: dict[int, dict[str, Box]] = {}
    for (index, state), box in rank_boxes(placement, rank).items():
        by_tensor.setdefault(index, {})[state] = box
    out: dict[Key, LocalShard] = {}
    with ExitStack() as stack:
        files = RegionFiles(source.dir, stack)
        for index, states in by_tensor.items():
            tensor = placement.model.tensors[index]
            weights = [box for state, box in states.items() if state in ("param", "master")]
            whole = None
            if weights:  # param and master boxes nest (a ZeRO chunk inside the TP box): read the outer once
                hull = (min(b[0] for b in weights), max(b[1] for b in weights),
                        min(b[2] for b in weights), max(b[3] for b in weights))
                # In the stored dtype, in a tensor of its own: each state copies its box out of it
                # (or is it, when the box is the whole region in the state's dtype).
                value = read_box(source.hfmap.pieces[tensor.name], box_ranges(tensor, hull), files.read)
                whole = LocalShard(tensor, "master", hull, value)
            for state, box in states.items():
                if state in ("exp_avg", "exp_avg_sq"):
                    data = untouched_zeros(_shape(tensor, box), DTYPES[state])
                elif box == hull and value.dtype == DTYPES[state]:
                    data = value  # the region read is a tensor of its own: it is the state, no copy
                else:
                    assert whole is not None
                    data = cast_copy(whole.region(box), DTYPES[state])
                out[(index, state)] = LocalShard(tensor, state, box, data)
    return out


def cast_copy(region: Tensor, dtype: torch.dtype) -> Tensor:
    """`region` as `dtype` in a tensor of its own: one cast-copy out of the stored values (a
    bf16 param of a bf16 checkpoint is a plain copy, no fp32 round trip), never a view that
    would keep the whole read region, or the mapped file, alive. A param is the bf16 cast of
    the fp32 master: from F32 and BF16 values a direct cast is that; F16 goes through fp32."""
    if dtype != torch.float32 and region.dtype not in (torch.float32, dtype):
        region = region.to(torch.float32)
    return torch.empty(region.shape, dtype=dtype).copy_(region)


def _shape(tensor: TensorSpec, box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box_ranges(tensor, box))


def read_hf_tensors(hf_dir: str, names: list[str] | None = None,
                    dtype: torch.dtype | None = torch.float32) -> dict[str, Tensor]:
    """Whole logical tensors (all, or `names`) of a checked Hugging Face directory, cast to
    `dtype` (None: as stored), in one process: for tests, conversions and small models."""
    source = open_hf_source(hf_dir)
    chosen = list(source.hfmap.pieces) if names is None else names
    out: dict[str, Tensor] = {}
    cast: Callable[[Tensor], Tensor] = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    with ExitStack() as stack:
        files = RegionFiles(source.dir, stack)
        for name in chosen:
            shape = source.hfmap.logical_shape(name)
            out[name] = cast(read_box(source.hfmap.pieces[name], tuple((0, n) for n in shape), files.read))
    return out
