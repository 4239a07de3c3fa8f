"""`dataset.json`: what a dataset directory holds, written by `dynaplane data prepare` (or by hand
for files people already have) and read, checked, by every loader.

    {"version": 1, "name": "stdlib", "format": "megatron", "prefix": "data",
     "vocab_size": 257, "eos_token": 256, "tokenizer": {"kind": "bytes"},
     "validation_fraction": 0.01, "documents": 1934, "tokens": 28311022,
     "fingerprint": "sha256:..."}

format "megatron": PREFIX.bin/.idx beside the manifest; "tokens": a raw token file (`file`,
`token_dtype` uint16/uint32/int32, `header` none/llm.c); "blend": `parts`, each {"path": a dataset
directory (relative to this one or absolute), "weight": > 0}.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from parallelism.datasets.errors import DatasetError

MANIFEST = "dataset.json"
FORMATS = ("megatron", "tokens", "blend")
VERSION = 1


@dataclass(frozen=True)
class BlendPart:
    path: Path
    weight: float


@dataclass(frozen=True)
class Manifest:
    directory: Path
    name: str
    format: str
    vocab_size: int
    fingerprint: str
    validation_fraction: float = 0.0
    eos_token: int | None = None
    tokenizer: dict = field(default_factory=dict)
    prefix: str = "data"
    file: str = ""
    token_dtype: str = "uint16"
    header: str = "none"
    documents: int = 0
    tokens: int = 0
    parts: tuple[BlendPart, ...] = ()
    blend_period: int = 1000
    text_bytes: int = 0  # UTF-8 bytes of the documents' text, when prepare wrote it (0: unknown)

    @property
    def bytes_per_token(self) -> float | None:
        """For bits per byte (a tokenizer-independent loss): loss / ln 2 / bytes_per_token."""
        return self.text_bytes / self.tokens if self.text_bytes and self.tokens else None

    def to_json(self) -> dict:
        out = {"version": VERSION, "name": self.name, "format": self.format, "vocab_size": self.vocab_size,
               "fingerprint": self.fingerprint, "validation_fraction": self.validation_fraction,
               "eos_token": self.eos_token, "tokenizer": self.tokenizer, "documents": self.documents,
               "tokens": self.tokens, **({"text_bytes": self.text_bytes} if self.text_bytes else {})}
        if self.format == "megatron":
            out["prefix"] = self.prefix
        elif self.format == "tokens":
            out.update(file=self.file, token_dtype=self.token_dtype, header=self.header)
        else:
            out.update(parts=[{"path": str(p.path), "weight": p.weight} for p in self.parts],
                       blend_period=self.blend_period)
        return out


def _require(raw: dict, key: str, kind, where: str, *, minimum=None, default=...):
    if key not in raw or raw[key] is None:
        if default is not ...:
            return default
        raise DatasetError(f"{where}: missing key {key!r}")
    value = raw[key]
    ok = isinstance(value, kind) and not (kind in (int, (int, float)) and isinstance(value, bool))
    if not ok or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        noun = {int: "an integer", str: "a string", list: "a list", dict: "an object"}.get(kind, "a number")
        raise DatasetError(f"{where}: {key}={value!r} must be {noun}{bound}")
    return value


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The checked manifest of a dataset directory (DatasetError naming the file and the key)."""
    directory = Path(directory)
    path = directory / MANIFEST
    where = f"{directory.name}/{MANIFEST}"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(f"{where}: missing (a dataset directory holds a {MANIFEST}; "
                           "`dynaplane data prepare` writes one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{where}: not readable JSON ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: must hold a JSON object")
    version = _require(raw, "version", int, where)
    if version != VERSION:
        raise DatasetError(f"{where}: version {version}, this dynaplane reads version {VERSION}")
    fmt = _require(raw, "format", str, where)
    if fmt not in FORMATS:
        raise DatasetError(f"{where}: format {fmt!r} unknown ({', '.join(FORMATS)})")
    fraction = float(_require(raw, "validation_fraction", (int, float), where, minimum=0, default=0.0))
    if fraction >= 1:
        raise DatasetError(f"{where}: validation_fraction={fraction} must be below 1")
    common = dict(directory=directory, name=_require(raw, "name", str, where, default=directory.name), format=fmt,
                  vocab_size=_require(raw, "vocab_size", int, where, minimum=1),
                  fingerprint=_require(raw, "fingerprint", str, where), validation_fraction=fraction,
                  eos_token=_require(raw, "eos_token", int, where, minimum=0, default=None),
                  tokenizer=_require(raw, "tokenizer", dict, where, default={}),
                  documents=_require(raw, "documents", int, where, minimum=0, default=0),
                  tokens=_require(raw, "tokens", int, where, minimum=0, default=0),
                  text_bytes=_require(raw, "text_bytes", int, where, minimum=0, default=0))
    if fmt == "megatron":
        return Manifest(**common, prefix=_safe_name(_require(raw, "prefix", str, where), where, "prefix"))
    if fmt == "tokens":
        return Manifest(**common, file=_safe_name(_require(raw, "file", str, where), where, "file"),
                        token_dtype=_require(raw, "token_dtype", str, where, default="uint16"),
                        header=_require(raw, "header", str, where, default="none"))
    parts = _require(raw, "parts", list, where)
    if not parts:
        raise DatasetError(f"{where}: a blend needs at least one part")
    out = []
    for n, part in enumerate(parts):
        if not isinstance(part, dict):
            raise DatasetError(f"{where}: parts[{n}] must be an object with path and weight")
        p = Path(_require(part, "path", str, f"{where} parts[{n}]"))
        weight = float(_require(part, "weight", (int, float), f"{where} parts[{n}]"))
        if not weight > 0:
            raise DatasetError(f"{where}: parts[{n}].weight={weight} must be above 0")
        out.append(BlendPart(p if p.is_absolute() else directory / p, weight))
    return Manifest(**common, parts=tuple(out),
                    blend_period=_require(raw, "blend_period", int, where, minimum=len(out), default=1000))


def _safe_name(value: str, where: str, key: str) -> str:
    """A file name beside the manifest: no directories, so a manifest cannot point outside its own folder."""
    if not value or "/" in value or "\\" in value or value in (".", ".."):
        raise DatasetError(f"{where}: {key}={value!r} must be a plain file name beside the manifest")
    return value


def write_manifest(manifest: Manifest) -> Path:
    path = manifest.directory / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def file_digest(paths: list[Path], progress=None, chunk: int = 1 << 22) -> str:
    """sha256 over the files' bytes, in order (`progress(n_bytes)` after each chunk)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
                if progress:
                    progress(len(block))
    return "sha256:" + h.hexdigest()
