"""Tiny dataset directories for tests, written by the dataset library itself: `text_dataset`
through `prepare` (byte tokens, vocab 257), `token_dataset` through the IndexedWriter with a
hand-written manifest (any vocab, e.g. one larger than a model's)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from parallelism.datasets.indexed import IndexedWriter
from parallelism.datasets.manifest import Manifest, file_digest, write_manifest
from parallelism.datasets.prepare import prepare

TEXTS = ["def add(a, b):\n    return a + b\n" * 8, "class Point:\n    x: int = 0\n    y: int = 0\n" * 8,
         "import os\nprint(os.getcwd())\n" * 8, "for i in range(10):\n    print(i * i)\n" * 8]


def text_dataset(directory: Path, texts: list[str] = TEXTS, validation_fraction: float = 0.0,
                 name: str | None = None) -> Path:
    """`dynaplane data prepare` of one .py file per text into `directory` (byte tokens; a dataset
    already there is replaced)."""
    source = directory.parent / f".{directory.name}-source"
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    for n, text in enumerate(texts):
        (source / f"doc{n:03d}.py").write_text(text)
    prepare([source], directory, validation_fraction=validation_fraction, name=name, force=True, progress=False)
    return directory


def token_dataset(directory: Path, documents: list[list[int]], vocab_size: int, name: str | None = None) -> Path:
    """A Megatron indexed dataset of these token documents, its manifest saying `vocab_size`."""
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size < 65_500 else np.int32
    with IndexedWriter(directory / "data", dtype) as writer:
        for doc in documents:
            writer.add(doc)
    fingerprint = file_digest([directory / "data.bin", directory / "data.idx"])
    write_manifest(Manifest(directory=directory, name=name or directory.name, format="megatron",
                            vocab_size=vocab_size, fingerprint=fingerprint, tokenizer={"kind": "hf"},
                            documents=len(documents), tokens=sum(map(len, documents))))
    return directory
