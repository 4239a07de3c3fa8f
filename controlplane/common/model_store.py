"""The models a job or an emulation can name: the catalog, and Hugging Face config.json
files stored under parallelism.layout.catalog.models_dir() (<name>/config.json), which every
agent of the cluster reads too. An upload is bounded: a JSON object of at most
MAX_CONFIG_BYTES, stored under a plain name (catalog.MODEL_NAME_RE, never a path) that is
neither a catalog name nor a stored model already (a stored config is never replaced: a job
may train from it), and only once parallelism.layout's reader accepts it. It is written into a
temporary folder beside its place and renamed there, so a reader never sees half a file."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

from parallelism.layout.catalog import (MODEL_NAME_RE, catalog_names, get_config, get_model, model_summary, models_dir,
                                   stored_config_path)
from parallelism.layout.errors import LayoutError
from parallelism.layout.hf_config import load_hf_config
from controlplane.common.errors import InvalidInput

MAX_CONFIG_BYTES = 64 * 1024  # a Hugging Face config.json is 1-5 KiB
# The counts that size the work of reading and describing a model (a tensor list per layer
# and expert): far above every published model (Llama 3 405B: 126 layers; 256 experts at
# most), far below what would keep a request busy for long.
COUNT_LIMITS = {"num_hidden_layers": 1024, "n_layer": 1024, "num_local_experts": 1024, "num_experts": 1024,
                "decoder_sparse_step": 1024}
UPLOAD_PREFIX = ".upload-"


def _summary(name: str, source: str) -> dict:
    summary = model_summary(get_model(name, paths=False))
    config = get_config(name, paths=False)
    if source == "stored":  # (the reader's description names the file's place on the server)
        summary["description"] = f"{summary['family']} model from an uploaded config.json"
    return {**summary, "name": name, "source": source, "positions": config.llm.positions or None, "error": ""}


def model_list() -> list[dict]:
    """The catalog's models, then the stored ones by name; a stored config the reader
    refuses is listed with its error (named by its name, not its place on the server)."""
    rows = [_summary(name, "catalog") for name in catalog_names()]
    root = models_dir()
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    catalog = set(catalog_names())
    for name in names:
        if name in catalog or name.startswith(UPLOAD_PREFIX) or stored_config_path(name) is None:
            continue
        try:
            rows.append(_summary(name, "stored"))
        except LayoutError as exc:
            rows.append({"name": name, "source": "stored", "error": str(exc)})
    return rows


def model_store(*, name: str, config: dict) -> dict:
    """Store an uploaded config.json as model `name`; its summary, or InvalidInput."""
    if not MODEL_NAME_RE.match(name) or ".." in name:
        raise InvalidInput({"name": [f"{name[:100]!r} is not a model name: letters, digits, '.', '_' and '-', "
                                     f"starting with a letter or digit, at most 100 characters, no '..'"]})
    if name in catalog_names():
        raise InvalidInput({"name": [f"{name!r} is a catalog model; store the config under another name"]})
    if not isinstance(config, dict):
        raise InvalidInput({"config": [f"a config.json holds a JSON object, not {type(config).__name__}"]})
    for key, limit in COUNT_LIMITS.items():
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise InvalidInput({"config": [f"{key}={value} is more than {limit} (the most a stored model may have)"]})
    text = json.dumps(config, indent=2, allow_nan=False)
    if len(text.encode()) > MAX_CONFIG_BYTES:
        raise InvalidInput({"config": [f"{len(text.encode()):,} bytes is more than a config.json may be "
                                       f"({MAX_CONFIG_BYTES // 1024} KiB)"]})
    root = models_dir()
    target = os.path.join(root, name)
    if os.path.exists(target):
        raise InvalidInput({"name": [f"a model named {name!r} is stored already (stored configs are never "
                                     f"replaced: pick another name)"]})
    os.makedirs(root, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=UPLOAD_PREFIX, dir=root)
    try:
        path = os.path.join(folder, "config.json")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        try:
            load_hf_config(path)
        except LayoutError as exc:
            raise InvalidInput({"config": [str(exc).replace(path, "config.json")]}) from None
        try:
            os.rename(folder, target)  # fails when another upload took the name meanwhile
        except OSError:
            raise InvalidInput({"name": [f"a model named {name!r} is stored already"]}) from None
    finally:
        if os.path.isdir(folder):
            shutil.rmtree(folder, ignore_errors=True)
    return _summary(name, "stored")
