"""Hugging Face model directories a job starts from (`init_from`, docs/hf-weights.md): under the
weights root (settings.DYNAPLANE_WEIGHTS_ROOT, shared storage every node mounts at the same path),
named relative to it (or absolute inside it; nothing may lead out of it), and checked with bounded
work by the hf_weights library: config.json, the index and every safetensors header, no tensor
data. Refusals are InvalidInput naming the field and the rule in the library's words, with paths
relative to the weights root (never an absolute path of the server).

A job that gives `init_from` and no `model` trains the model config.json describes: it is stored as
a model (controlplane/common/model_store.py) under a name made from the directory's path, which
every agent resolves as it resolves an uploaded config (a stored config equal to it is reused)."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from django.conf import settings

from parallelism.layout.catalog import catalog_names, model_from_config, models_dir, stored_config_path
from parallelism.layout.model_config import ModelConfig
from parallelism.layout.tensors import Model
from controlplane.common.errors import InvalidInput
from controlplane.common.folders import Root, escaping_entry, folder_under
from controlplane.common.model_store import model_store

MAX_PATH = 1000
MAX_ENTRIES = 10_000  # files of a model directory looked at for symlinks: bounded work
NAME_TRIES = 20  # stored-model names tried for one directory (`<name>`, `<name>-2`, ...)


def weights_root() -> Root:
    return Root(settings.DYNAPLANE_WEIGHTS_ROOT, "weights root", "DYNAPLANE_WEIGHTS_ROOT")


def weights_directory(relative: str) -> str:
    """The absolute path every rank reads a job's `init_from` (stored relative to the root) from."""
    return os.path.join(settings.DYNAPLANE_WEIGHTS_ROOT, relative)


@dataclass(frozen=True)
class InitialWeights:
    """A checked model directory: where it is, and what its config.json says."""

    directory: str  # absolute, real
    relative: str  # to the weights root
    config: ModelConfig
    raw_config: dict


def weights_problem(exc: Exception) -> str:
    """What the hf_weights library said (HFWeightsError, a ValueError), told from the weights
    root; another error by its type (never its text: it may name a server path)."""
    from parallelism.hf_weights import HFWeightsError

    if isinstance(exc, HFWeightsError):
        return weights_root().strip(str(exc))
    return f"could not be read ({type(exc).__name__})"


def _refuse(field: str, message: str) -> InvalidInput:
    return InvalidInput({field: [message]})


def initial_weights(value: str, field: str = "init_from") -> InitialWeights:
    """The model directory an API input names, and its config.json's model; InvalidInput at
    `field` when it lies outside the weights root (a symlink among its files leading out too), is
    no directory, or its config.json is missing, unreadable or of an unsupported model."""
    from parallelism.hf_weights import hf_model_config
    from parallelism.hf_weights.hf_files import CONFIG, read_json

    directory, relative = folder_under(
        weights_root(), value, field=field, max_length=MAX_PATH,
        empty="give the Hugging Face model directory, relative to the weights root (e.g. qwen2-0.5b)",
        missing=lambda _: " (a Hugging Face model directory: config.json and its safetensors files, copied "
                          "or downloaded there, e.g. `hf download <repo> --local-dir <weights root>/<name>`)")
    try:
        with os.scandir(directory) as entries:
            names = [entry.name for _, entry in zip(range(MAX_ENTRIES + 1), entries)]
    except OSError as exc:
        raise _refuse(field, f"{relative}: could not be read ({type(exc).__name__})") from None
    if len(names) > MAX_ENTRIES:
        raise _refuse(field, f"{relative}: holds more than {MAX_ENTRIES:,} files; a model directory holds "
                             f"config.json, the weights and the tokenizer files")
    escape = escaping_entry(weights_root(), directory, names)
    if escape is not None:
        raise _refuse(field, f"{relative}/{escape}: leads outside the weights root (a symlink); the weights must "
                             f"lie under it")
    try:
        config = hf_model_config(directory)
        raw = read_json(os.path.join(directory, CONFIG))
    except (ValueError, OSError) as exc:
        raise _refuse(field, weights_problem(exc)) from None
    return InitialWeights(directory, relative, config, raw)


def model_difference(model: Model, theirs: Model) -> str | None:
    """The first tensor where `model` and the model of config.json differ (name or shape), in
    words; None when they are the same model."""
    ours = {t.name: t.shape for t in model.tensors}
    other = {t.name: t.shape for t in theirs.tensors}
    for t in model.tensors:
        if t.name not in other:
            return f"{model.name} has a tensor {t.name} {tuple(t.shape)} that its config.json's model lacks"
        if tuple(other[t.name]) != tuple(t.shape):
            return f"tensor {t.name} has shape {tuple(other[t.name])} there, {tuple(t.shape)} in {model.name}"
    for t in theirs.tensors:
        if t.name not in ours:
            return f"its config.json's model has a tensor {t.name} {tuple(t.shape)} that {model.name} lacks"
    return None


def check_initial_weights(weights: InitialWeights, model: Model, field: str = "init_from") -> None:
    """`weights` hold `model`: config.json describes it (the same tensors, names and shapes), and
    every file's header has each tensor the adapter maps, with the shape config.json implies
    (open_hf_source: headers only, no tensor data). InvalidInput at `field` names the first
    mismatching tensor, or the file and the rule."""
    from parallelism.hf_weights import open_hf_source

    difference = model_difference(model, model_from_config(weights.config))
    if difference is not None:
        raise _refuse(field, f"{weights.relative}/config.json describes another model than {model.name}: {difference}")
    try:
        open_hf_source(weights.directory, model)
    except (ValueError, OSError) as exc:
        raise _refuse(field, weights_problem(exc)) from None


def _name_base(relative: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", relative.replace(os.sep, "--"))
    while ".." in name:
        name = name.replace("..", ".")
    name = re.sub(r"^[^A-Za-z0-9]+", "", name)[:90]
    return name or "weights"


def _stored_config(name: str) -> dict | None:
    path = stored_config_path(name)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def initial_model_name(weights: InitialWeights) -> tuple[str, bool]:
    """The stored model a job starting from `weights` without a `model` trains: (name, whether it
    must still be stored). A stored config equal to config.json is reused; otherwise the first
    free name of `<path>`, `<path>-2`, ... (the directory's path under the root, `/` as `--`)."""
    base = _name_base(weights.relative)
    catalog = set(catalog_names())
    for n in range(1, NAME_TRIES + 1):
        name = base if n == 1 else f"{base}-{n}"
        if name in catalog:
            continue
        stored = _stored_config(name)
        if stored is not None and stored == weights.raw_config:
            return name, False
        if stored is None and not os.path.exists(os.path.join(models_dir(), name)):
            return name, True
    raise _refuse("init_from", f"{weights.relative}: the stored model names {base}, {base}-2, ... {base}-{NAME_TRIES} "
                               f"are all taken by other configs; give `model` (a stored model of this config)")


def store_initial_model(weights: InitialWeights, field: str = "init_from") -> str:
    """Store config.json as the job's model (initial_model_name) unless an equal one is stored;
    its name. InvalidInput at `field` when the model store refuses the config (too large, ...)."""
    for _ in range(3):  # (another request may take the name meanwhile: look again)
        name, needed = initial_model_name(weights)
        if not needed:
            return name
        try:
            model_store(name=name, config=weights.raw_config)
            return name
        except InvalidInput as exc:
            if "config" in exc.errors:
                raise _refuse(field, f"{weights.relative}/config.json: {' '.join(exc.errors['config'])}") from None
    raise _refuse(field, f"{weights.relative}: its config could not be stored as a model (the names were taken "
                         f"meanwhile); try again")
