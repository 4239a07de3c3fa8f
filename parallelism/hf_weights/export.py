"""Write a Hugging Face model directory (safetensors + config.json, and the source's tokenizer
and generation_config.json files) that transformers loads, from our logical tensors.

Three entry points, one writer:
- `export_hf(out_dir, tensors, ...)`: whole logical tensors in memory (any dtype; fp32 masters
  assembled from shards, gather.py, or read_hf_tensors);
- `export_hf_from_checkpoint(checkpoint_dir, out_dir, ...)`: the project's own DCP checkpoint
  (agents/runtime/checkpoints.py, parallelism/engine/checkpoint.py): fp32 masters read by DCP,
  resharded to whole tensors, one output file's worth at a time;
- `export_hf_from_shards(placement, rank, shards, out_dir, ...)`: a running trainer's
  hand_over() shards, collective: every rank saves its master boxes with DCP to a scratch
  checkpoint, rank 0 exports it.

Files are written with torch's HuggingFaceStorageWriter (dcp.save, no_dist), one file per
call, so memory holds one output file's tensors. Given the source directory of an imported
model, the export keeps its file split (each tensor in the file of the same name), its
names' variant (GPT-2 prefix, per-expert or fused experts) and, unless `dtype` is given,
each tensor's stored dtype: HF -> dynaplane -> HF without training is byte-identical.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from parallelism.hf_weights.config_out import DTYPE_JSON_NAMES, hf_config_dict
from parallelism.hf_weights.convert import hf_tensor
from parallelism.hf_weights.errors import HFWeightsError
from parallelism.hf_weights.families import hf_map, model_type_of
from parallelism.hf_weights.hf_files import CONFIG, INDEX, SINGLE
from parallelism.hf_weights.load import HFSource, check_same_model, open_hf_source
from parallelism.hf_weights.pieces import HFMap, Variant
from parallelism.layout.catalog import model_from_config
from parallelism.layout.model_config import ModelConfig

# Files of a model directory that are not weights and travel with an export unchanged.
COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# names -> those logical tensors, whole (any float dtype)
Fetch = Callable[[Sequence[str]], Mapping[str, Tensor]]


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: every HF tensor's file (1..N) and dtype, and config.json."""

    config: ModelConfig
    hfmap: HFMap
    files: dict[str, int]
    dtypes: dict[str, torch.dtype]
    config_json: dict
    source: HFSource | None

    @property
    def file_count(self) -> int:
        return max(self.files.values())


def plan_export(config: ModelConfig | None = None, *, source_dir: str | None = None, dtype: torch.dtype | None = None,
                variant: Variant | None = None, max_file_bytes: int | None = None) -> ExportPlan:
    """The export of `config` (default: source_dir's config.json): with `source_dir`, its model_type,
    names' variant, file split and dtypes (each overridable); else the family's model_type, the
    names save_pretrained writes, bf16, one file or files of at most max_file_bytes."""
    source = open_hf_source(source_dir) if source_dir is not None else None
    if config is None:
        if source is None:
            raise HFWeightsError("an export needs the model's config or a source directory")
        config = source.config
    if config.encoder is not None:
        raise HFWeightsError(f"{config.name}: has an image encoder; only decoder-only models are exported")
    if source is not None:
        check_same_model(model_from_config(config), source.model, source.dir.config_path)
        model_type = source.dir.model_type
    else:
        model_type = model_type_of(config.family)
    chosen = variant or (source.hfmap.variant if source is not None else
                         Variant(prefix="transformer." if model_type == "gpt2" else ""))
    hfmap = hf_map(config.llm, model_type, chosen)
    shapes = hfmap.hf_shapes
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise HFWeightsError(f"dtype {dtype} cannot be exported (one of {', '.join(map(str, DTYPE_NAMES))})")
    dtypes = {n: dtype or (TORCH_DTYPES[source.dir.dtypes[n]] if source is not None and n in source.dir.dtypes
                           else torch.bfloat16) for n in shapes}
    if source is not None and max_file_bytes is None and all(n in source.dir.files for n in shapes):
        names = sorted(set(source.dir.files[n] for n in shapes))
        files = {n: names.index(source.dir.files[n]) + 1 for n in shapes}
    else:
        files = _split(shapes, dtypes, max_file_bytes)
    stored = {DTYPE_NAMES[d] for d in dtypes.values()}
    dtype_name = stored.pop() if len(stored) == 1 else "BF16"
    if source is not None:
        config_json = dict(source.dir.raw_config)
        key = "torch_dtype" if "torch_dtype" in config_json and "dtype" not in config_json else "dtype"
        config_json[key] = DTYPE_JSON_NAMES[dtype_name]
    else:
        config_json = hf_config_dict(config, model_type, dtype_name)
    return ExportPlan(config, hfmap, files, dtypes, config_json, source)


def _split(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], limit: int | None) -> dict[str, int]:
    """File index of every tensor, in map order, a new file whenever `limit` bytes would be passed."""
    out, index, size = {}, 1, 0
    for name, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * dtypes[name].itemsize
        if limit is not None and size and size + nbytes > limit:
            index, size = index + 1, 0
        out[name], size = index, size + nbytes
    return out


def file_name(index: int, count: int) -> str:
    """save_pretrained's (and HuggingFaceStorageWriter's) name of file `index` of `count`."""
    return SINGLE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def write_export(plan: ExportPlan, out_dir: str, fetch: Fetch) -> list[str]:
    """Write plan's files into out_dir (created; it must hold no weights yet), fetching the logical
    tensors each file needs; returns the paths written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    os.makedirs(out_dir, exist_ok=True)
    existing = [f for f in os.listdir(out_dir) if f.endswith(".safetensors") or f == INDEX]
    if existing:
        raise HFWeightsError(f"{out_dir}: already holds weights ({', '.join(sorted(existing)[:3])}); "
                             f"export into an empty directory")
    parts = plan.hfmap.by_hf_name()
    count = plan.file_count
    written: list[str] = []
    for index in range(1, count + 1):
        names = [n for n, i in plan.files.items() if i == index]
        needed = sorted({logical for n in names for logical, _ in parts[n]})
        logical = fetch(needed)
        _check_logical(plan, logical, needed)
        tensors = {n: hf_tensor(n, parts[n], logical, plan.dtypes[n]) for n in names}
        del logical
        writer = HuggingFaceStorageWriter(out_dir, fqn_to_index_mapping=plan.files)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, storage_writer=writer, no_dist=True)
        written.append(os.path.join(out_dir, f"model-{index:05d}-of-{count:05d}.safetensors"))
    index_path = os.path.join(out_dir, INDEX)
    if count == 1:  # one file: model.safetensors and no index, as save_pretrained writes it
        os.replace(written[0], os.path.join(out_dir, SINGLE))
        written = [os.path.join(out_dir, SINGLE)]
        if os.path.exists(index_path):
            os.remove(index_path)
    else:
        total = sum(torch.Size(s).numel() * plan.dtypes[n].itemsize for n, s in plan.hfmap.hf_shapes.items())
        weight_map = {n: file_name(plan.files[n], count) for n in sorted(plan.files)}
        with open(index_path, "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(index_path)
    if plan.source is not None and plan.config_json == plan.source.dir.raw_config:
        shutil.copyfile(plan.source.dir.config_path, os.path.join(out_dir, CONFIG))  # unchanged: the same bytes
    else:
        with open(os.path.join(out_dir, CONFIG), "w", encoding="utf-8") as f:
            json.dump(plan.config_json, f, indent=2)
    written.append(os.path.join(out_dir, CONFIG))
    if plan.source is not None:
        for name in COMPANION_FILES:
            path = os.path.join(plan.source.dir.path, name)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(out_dir, name))
                written.append(os.path.join(out_dir, name))
    return written


def _check_logical(plan: ExportPlan, logical: Mapping[str, Tensor], names: Sequence[str]) -> None:
    for name in names:
        if name not in logical:
            raise HFWeightsError(f"no tensor {name!r} to export ({plan.config.name} needs it)")
        shape, expected = tuple(logical[name].shape), plan.hfmap.logical_shape(name)
        if shape != expected:
            raise HFWeightsError(f"{name}: shape {shape}, but {plan.config.name} has {expected}")
        if not logical[name].is_floating_point():
            raise HFWeightsError(f"{name}: dtype {logical[name].dtype} is not a float dtype")


def export_hf(out_dir: str, tensors: Mapping[str, Tensor], *, config: ModelConfig | None = None,
              source_dir: str | None = None, dtype: torch.dtype | None = None, variant: Variant | None = None,
              max_file_bytes: int | None = None) -> list[str]:
    """Write whole logical tensors (our names, e.g. "llm.layers.0.attn.q.weight") as a Hugging Face
    directory; see plan_export for config/source_dir/dtype/variant/max_file_bytes. Returns the paths."""
    plan = plan_export(config, source_dir=source_dir, dtype=dtype, variant=variant, max_file_bytes=max_file_bytes)
    unknown = sorted(set(tensors) - set(plan.hfmap.pieces))
    if unknown:
        raise HFWeightsError(f"{unknown[0]!r} is not a tensor of {plan.config.name} ({len(unknown)} unknown)")
    return write_export(plan, out_dir, lambda names: tensors)


def export_hf_from_checkpoint(checkpoint_dir: str, out_dir: str, *, config: ModelConfig | None = None,
                              source_dir: str | None = None, dtype: torch.dtype | None = None,
                              variant: Variant | None = None, max_file_bytes: int | None = None) -> list[str]:
    """Export the fp32 masters of one of the project's DCP checkpoints (a `step-*` folder of
    agents/runtime/checkpoints.py, or any dcp.save of parallelism/engine/checkpoint.to_dtensors);
    `config` is the trained model's (TrainConfig.model_config) unless source_dir says it."""
    from parallelism.hf_weights.gather import check_checkpoint, read_checkpoint_masters

    plan = plan_export(config, source_dir=source_dir, dtype=dtype, variant=variant, max_file_bytes=max_file_bytes)
    model = model_from_config(plan.config)
    check_checkpoint(checkpoint_dir, model)
    return write_export(plan, out_dir, lambda names: read_checkpoint_masters(checkpoint_dir, model, names))


def export_hf_from_shards(placement, rank: int, shards: Mapping, out_dir: str, *, meshes: dict | None = None,
                          group=None, scratch_dir: str | None = None, config: ModelConfig | None = None,
                          source_dir: str | None = None, dtype: torch.dtype | None = None,
                          variant: Variant | None = None, max_file_bytes: int | None = None) -> None:
    """Collective over the default process group (every rank calls it, holder or not): export the
    master boxes of a running trainer's hand_over() `shards` (the trainer is rebuilt from them
    after, as agents/runtime/checkpoints.Checkpointer.save does). The masters go through a
    DCP scratch checkpoint (`scratch_dir`, default out_dir + ".masters", on a filesystem every
    rank and rank 0 share) that rank 0 exports and removes. `meshes`: layout_meshes(placement)
    when the caller has them (building them is collective too); `group`: dcp.save's group.
    `config` (the trained model's, TrainConfig.model_config) or `source_dir` says the model.
    Every rank raises HFWeightsError if rank 0's export fails."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from parallelism.engine.checkpoint import layout_meshes, to_dtensors
    from parallelism.engine.shards import state_device

    scratch = scratch_dir or out_dir.rstrip("/") + ".masters"
    masters = {key: shard for key, shard in shards.items() if key[1] == "master"}
    meshes = meshes if meshes is not None else layout_meshes(placement, state_device(masters, group).type)
    dcp.save(to_dtensors(placement, rank, masters, meshes), checkpoint_id=scratch, process_group=group)
    failure = [None]
    if rank == 0:
        try:
            export_hf_from_checkpoint(scratch, out_dir, config=config, source_dir=source_dir, dtype=dtype,
                                      variant=variant, max_file_bytes=max_file_bytes)
        except Exception as exc:  # every rank learns it, none hangs
            failure = [f"{type(exc).__name__}: {exc}"]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    dist.broadcast_object_list(failure, src=0, group=group)
    if failure[0] is not None:
        raise HFWeightsError(f"export to {out_dir} failed on rank 0: {failure[0]}")
