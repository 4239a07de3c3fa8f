"""A Hugging Face model directory on disk: config.json, then model.safetensors or the shards
named by model.safetensors.index.json. Everything here reads headers only (names, shapes,
dtypes); tensor data is read by region later (region_read.py)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from parallelism.hf_weights.errors import HFWeightsError
from parallelism.hf_weights.pieces import HFMap

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16")  # safetensors' names of the dtypes a weight may be stored in
_VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight", "wte.weight")


@dataclass(frozen=True)
class HFDir:
    """What a model directory holds, from config.json, the index and the safetensors headers."""

    path: str
    raw_config: dict[str, Any]
    files: dict[str, str]  # HF name -> safetensors file name (relative to path)
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]  # HF name -> safetensors dtype ("BF16", "F32", ...)
    index: dict[str, Any] | None  # model.safetensors.index.json, when sharded

    @property
    def model_type(self) -> str:
        return self.raw_config.get("model_type", "")

    @property
    def config_path(self) -> str:
        return os.path.join(self.path, CONFIG)

    def file_of(self, hf_name: str) -> str:
        return os.path.join(self.path, self.files[hf_name])


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise HFWeightsError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFWeightsError(f"{path}: cannot read it as JSON: {exc}") from None


def read_hf_dir(path: str) -> HFDir:
    """config.json and every safetensors header of the model directory `path`; HFWeightsError
    names a missing or unreadable file (an index's shard included) and a tensor the index
    places in a file that lacks it."""
    if not os.path.isdir(path):
        raise HFWeightsError(f"{path}: not a directory (a Hugging Face model directory is expected)")
    raw = read_json(os.path.join(path, CONFIG))
    if not isinstance(raw, dict):
        raise HFWeightsError(f"{os.path.join(path, CONFIG)}: must hold a JSON object")
    index_path = os.path.join(path, INDEX)
    index = None
    if os.path.exists(index_path):
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFWeightsError(f"{index_path}: no weight_map of tensor name -> file name")
        listed = dict(weight_map)
    elif os.path.exists(os.path.join(path, SINGLE)):
        listed = None
    else:
        others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
        hint = f"; found {', '.join(others)}, which is not read (safetensors only)" if others else ""
        raise HFWeightsError(f"{path}: no {SINGLE} nor {INDEX}{hint}")
    file_names = sorted(set(listed.values())) if listed is not None else [SINGLE]
    for name in file_names:
        if not os.path.isfile(os.path.join(path, name)):
            where = f" (listed in {INDEX} for {next(k for k, v in listed.items() if v == name)!r})" if listed else ""
            raise HFWeightsError(f"{os.path.join(path, name)}: missing shard file{where}")
    files: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for name in file_names:
        for key, (shape, dtype) in read_header(os.path.join(path, name)).items():
            if listed is not None and listed.get(key) != name:
                continue  # the index is what transformers reads: a tensor it does not place here is not loaded
            files[key], shapes[key], dtypes[key] = name, shape, dtype
    if listed is not None:
        absent = [k for k in listed if k not in files]
        if absent:
            raise HFWeightsError(f"{os.path.join(path, listed[absent[0]])}: has no tensor {absent[0]!r}, which "
                                 f"{INDEX} places there ({len(absent)} such tensors)")
    return HFDir(path, raw, files, shapes, dtypes, index)


def read_header(file: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor in one safetensors file, from its header."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            out = {}
            for key in f.keys():
                piece = f.get_slice(key)
                out[key] = (tuple(piece.get_shape()), piece.get_dtype())
            return out
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
        raise HFWeightsError(f"{file}: not a readable safetensors file: {exc}") from None


def check_tensors(hf: HFDir, hfmap: HFMap) -> None:
    """Every tensor `hfmap` needs is in `hf` with the shape config.json implies and a float dtype,
    and `hf` holds nothing else (bar hfmap.ignored); raises HFWeightsError naming the file and tensor."""
    expected = hfmap.hf_shapes
    unknown = [k for k in hf.files if k not in expected and not hfmap.is_ignored(k)]
    if unknown:
        raise HFWeightsError(f"{hf.file_of(unknown[0])}: tensor {unknown[0]!r} is not a weight of this "
                             f"{hfmap.model_type} model as config.json describes it ({len(unknown)} unknown: "
                             f"{', '.join(map(repr, unknown[:5]))})")
    missing = [k for k in expected if k not in hf.files]
    if missing:
        where = os.path.join(hf.path, INDEX if hf.index is not None else SINGLE)
        raise HFWeightsError(f"{where}: missing tensor {missing[0]!r} of shape {expected[missing[0]]}, which "
                             f"config.json implies ({len(missing)} missing: {', '.join(map(repr, missing[:5]))})")
    for key, shape in expected.items():
        got = hf.shapes[key]
        if got != shape:
            if key.endswith(_VOCAB_TENSORS) and got[1:] == shape[1:] and len(got) == len(shape):
                side = "larger" if got[0] > shape[0] else "smaller"
                raise HFWeightsError(f"{hf.file_of(key)}: {key} has {got[0]} rows but config.json's vocab_size is "
                                     f"{shape[0]}: the weights' vocabulary is {side} than the config's")
            raise HFWeightsError(f"{hf.file_of(key)}: {key} has shape {got} but config.json implies {shape}")
        if hf.dtypes[key] not in FLOAT_DTYPES:
            raise HFWeightsError(f"{hf.file_of(key)}: {key} is stored as {hf.dtypes[key]}; weights must be one of "
                                 f"{', '.join(FLOAT_DTYPES)}")
