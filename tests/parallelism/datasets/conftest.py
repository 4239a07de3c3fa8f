from __future__ import annotations

import numpy as np
import pytest

from parallelism.datasets.indexed import IndexedWriter
from parallelism.datasets.manifest import Manifest, file_digest, write_manifest


def make_dataset(directory, docs, *, vocab=300, fraction=0.0, name=None):
    """A megatron-format dataset directory from lists of token ids (a test's own corpus)."""
    directory.mkdir(parents=True, exist_ok=True)
    with IndexedWriter(directory / "data", np.uint16) as w:
        for d in docs:
            w.add(d)
    fingerprint = file_digest([directory / "data.bin", directory / "data.idx"])
    write_manifest(Manifest(directory=directory, name=name or directory.name, format="megatron", vocab_size=vocab,
                            fingerprint=fingerprint, validation_fraction=fraction, prefix="data",
                            documents=len(docs), tokens=sum(map(len, docs))))
    return directory


@pytest.fixture
def corpus(tmp_path):
    """40 documents of 5-60 tokens whose ids say where they are: token = 1 + (doc * 61 + offset) % 299."""
    rng = np.random.default_rng(1)
    docs = [[1 + (d * 61 + o) % 299 for o in range(int(rng.integers(5, 60)))] for d in range(40)]
    return docs, make_dataset(tmp_path / "corpus", docs, fraction=0.1)
