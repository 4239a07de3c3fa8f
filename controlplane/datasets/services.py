"""Writes to datasets: register a dataset directory that already lies under the data root
(checked by the dataset library's describe(): bounded work, the index read and checked, the
tokens not scanned), and delete a registration no job uses (the directory stays). Refusals are
InvalidInput (400) naming the field and the rule, with paths relative to the data root."""
from __future__ import annotations

import os

from django.db import IntegrityError, transaction
from django.db.models import ProtectedError

from controlplane.common.errors import Conflict, InvalidInput
from controlplane.common.limits import INT32_MAX
from controlplane.datasets.folders import READ_ERRORS, data_root, dataset_folder, inside, read_problem, relative_message
from controlplane.datasets.models import NAME_RE, NAME_RULE, Dataset

MAX_BLEND_PARTS = 256  # a blend's parts are each opened at registration: bounded work
def _escapes(directory: str) -> str | None:
    """Why the files the manifest names lead out of the data root (None: they do not)."""
    from parallelism.datasets.manifest import read_manifest

    root = data_root()
    manifest = read_manifest(directory)
    if manifest.format == "blend":
        if len(manifest.parts) > MAX_BLEND_PARTS:
            return f"dataset.json: a blend of {len(manifest.parts)} parts; at most {MAX_BLEND_PARTS} are registered"
        manifests = []
        for n, part in enumerate(manifest.parts):
            if not inside(root, os.path.realpath(part.path)):
                return f"dataset.json: parts[{n}] lies outside the data root (a blend's parts lie under it too)"
            manifests.append(read_manifest(part.path))
    else:
        manifests = [manifest]
    for m in manifests:
        names = [f"{m.prefix}.bin", f"{m.prefix}.idx"] if m.format == "megatron" else [m.file] if m.file else []
        for name in names:
            path = os.path.join(m.directory, name)
            if os.path.lexists(path) and not inside(root, os.path.realpath(path)):
                return f"{name}: leads outside the data root (a symlink); the data must lie under it"
    return None


def _stored_fields(info: dict, directory: str) -> dict:
    """describe()'s answer as the row stores it; a value a hand-written manifest put out of the
    columns' range is refused (InvalidInput at `path`)."""
    kind, tokenizer_fp, fingerprint = info["tokenizer"], info["tokenizer_fingerprint"], info["fingerprint"]
    problems = []
    if info["vocab_size"] > INT32_MAX:
        problems.append(f"vocab_size={info['vocab_size']} is above {INT32_MAX}")
    if info["eos_token"] is not None and info["eos_token"] > INT32_MAX:
        problems.append(f"eos_token={info['eos_token']} is above {INT32_MAX}")
    if not isinstance(kind, str) or not 0 < len(kind) <= 32:
        problems.append("tokenizer.kind must be a string of 1 to 32 characters")
    if not isinstance(tokenizer_fp, str) or len(tokenizer_fp) > 100:
        problems.append("tokenizer.fingerprint must be a string of at most 100 characters")
    if len(fingerprint) > 100:
        problems.append("fingerprint must be at most 100 characters")
    if problems:
        raise InvalidInput({"path": [relative_message(f"{os.path.basename(directory)}/dataset.json: "
                                                      f"{'; '.join(problems)}", directory)]})
    return dict(
        format=info["format"], vocab_size=info["vocab_size"], eos_token=info["eos_token"], tokenizer=kind,
        tokenizer_fingerprint=tokenizer_fp, fingerprint=fingerprint, documents=info["documents"],
        tokens=info["tokens"], train_tokens=info["train_tokens"], validation_tokens=info["validation_tokens"],
        validation_documents=info["validation_documents"], validation_fraction=info["validation_fraction"],
        parts=[{"name": str(p["name"])[:200], "weight": p["weight"], "tokens": p["tokens"]}
               for p in info.get("parts", [])])


def _name_for(name: str, info: dict, relative: str) -> str:
    if name:
        if not NAME_RE.match(name):
            raise InvalidInput({"name": [f"{name[:100]!r} is not a dataset name: {NAME_RULE}"]})
        return name
    for candidate in (info["name"], os.path.basename(relative)):
        if isinstance(candidate, str) and NAME_RE.match(candidate):
            return candidate
    raise InvalidInput({"name": [f"neither the manifest's name nor the directory's is a dataset name ({NAME_RULE}): "
                                 f"give one"]})


def dataset_register(*, path: str, name: str = "", created_by=None) -> Dataset:
    """Register the dataset directory `path` (relative to the data root, or absolute inside it)
    under `name` (default: the manifest's name, else the directory's). InvalidInput names `path`
    (outside the root, no directory, no or a broken dataset.json, a truncated .bin or corrupt
    .idx: the library's words) or `name` (not a name, or taken)."""
    from parallelism.datasets.describe import describe

    directory, relative = dataset_folder(path)
    try:
        escape = _escapes(directory)
        if escape is None:
            info = describe(directory, seq_len=1)  # (seq 1: any dataset with two tokens has a sample)
    except READ_ERRORS as exc:
        raise InvalidInput({"path": [read_problem(exc, directory)]}) from None
    if escape is not None:
        raise InvalidInput({"path": [relative_message(escape, directory)]})
    name = _name_for(name.strip(), info, relative)
    fields = _stored_fields(info, directory)
    try:
        with transaction.atomic():
            if Dataset.objects.filter(name=name).exists():
                raise InvalidInput({"name": [f"a dataset named {name!r} is registered already"]})
            taken = Dataset.objects.filter(path=relative).first()
            if taken is not None:
                raise InvalidInput({"path": [f"{relative} is registered already, as {taken.name!r}"]})
            return Dataset.objects.create(name=name, path=relative, created_by=created_by, **fields)
    except IntegrityError:  # registered meanwhile by another request
        raise InvalidInput({"name": [f"a dataset named {name!r} or at {relative} is registered already"]}) from None


def dataset_delete(*, dataset_id: int) -> None:
    """Forget a dataset no job names (its directory stays); Conflict (409) while one does."""
    with transaction.atomic():
        dataset = Dataset.objects.select_for_update().get(pk=dataset_id)
        users = list(dataset.jobs.order_by("name").values_list("name", flat=True)[:6])
        if users:
            more = ", ..." if len(users) > 5 else ""
            raise Conflict(f"dataset {dataset.name!r} is used by job(s) {', '.join(users[:5])}{more}; delete those "
                           f"jobs first")
        try:
            dataset.delete()
        except ProtectedError:
            raise Conflict(f"dataset {dataset.name!r} is used by a job; delete it first") from None
