"""Reads of datasets: the list (with the jobs that name each), one named by an API input (its
name or id), and a dataset's samples per epoch (its train split) and validation samples at a
sequence length, from the dataset library (cached per directory, seq and manifest version)."""
from __future__ import annotations

import os
from functools import lru_cache

from django.db.models import Count, QuerySet

from controlplane.common import inputs
from controlplane.common.errors import InvalidInput
from controlplane.datasets.folders import READ_ERRORS, read_problem
from controlplane.datasets.models import NAME_RE, Dataset


def dataset_list() -> QuerySet[Dataset]:
    """Every dataset by name, with `jobs_count`: the jobs that name it."""
    return Dataset.objects.annotate(jobs_count=Count("jobs")).order_by("name")


def dataset_of(value: str, field: str = "dataset") -> Dataset:
    """The dataset an API input names: its name, or its id (names are never digits alone)."""
    text = str(value).strip()
    pk = inputs.whole_number(text)
    found = None
    if pk is not None:
        found = Dataset.objects.filter(pk=pk).first()
    elif NAME_RE.match(text):  # (anything else names no dataset: never sent to the database)
        found = Dataset.objects.filter(name=text).first()
    if found is None:
        raise InvalidInput({field: [f"no dataset {text[:100]!r} is registered (GET /api/datasets lists them; "
                                    f"POST /api/datasets or `dynaplane data register` registers one)"]})
    return found


@lru_cache(maxsize=256)
def _described(directory: str, seq_len: int, manifest_version: tuple) -> dict:
    from parallelism.datasets.describe import describe

    return describe(directory, seq_len)


def dataset_samples_per_epoch(dataset: Dataset, seq_len: int, field: str = "dataset") -> int:
    """Samples of seq_len + 1 tokens in one epoch of the dataset's train split (describe()).
    InvalidInput at `field` when the directory cannot be read now, holds other data than was
    registered (its fingerprint changed), or has no sample of this length."""
    directory = dataset.directory
    try:
        stat = os.stat(os.path.join(directory, "dataset.json"))
        info = _described(directory, seq_len, (stat.st_mtime_ns, stat.st_size, stat.st_ino))
    except READ_ERRORS as exc:
        raise InvalidInput({field: [f"dataset {dataset.name!r}: {read_problem(exc, directory)}"]}) from None
    if info["fingerprint"] != dataset.fingerprint:
        raise InvalidInput({field: [f"dataset {dataset.name!r} holds other data than when it was registered "
                                    f"(fingerprint {info['fingerprint'][:19]}..., registered "
                                    f"{dataset.fingerprint[:19]}...): delete and register it again"]})
    return info["samples_per_epoch"]


@lru_cache(maxsize=256)
def _validation_samples(directory: str, seq_len: int, manifest_version: tuple) -> int:
    from parallelism.datasets.dataset import TokenDataset

    return TokenDataset(directory, seq_len, split="validation", cache=False).samples_per_epoch


def dataset_validation_samples(dataset: Dataset, seq_len: int, field: str = "eval_every") -> int:
    """Samples of seq_len + 1 tokens in the dataset's validation split (the dataset library's
    count). InvalidInput at `field` when it has none (no validation split, or fewer tokens than
    one sample) or the directory cannot be read now."""
    directory = dataset.directory
    try:
        stat = os.stat(os.path.join(directory, "dataset.json"))
        return _validation_samples(directory, seq_len, (stat.st_mtime_ns, stat.st_size, stat.st_ino))
    except READ_ERRORS as exc:
        raise InvalidInput({field: [f"dataset {dataset.name!r}: {read_problem(exc, directory)}"]}) from None
