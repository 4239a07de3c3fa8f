from __future__ import annotations

import numpy as np
import pytest

from tests.support.datasets import token_dataset


def make_dataset(directory, docs, *, vocab=300, fraction=0.0, name=None):
    """A megatron-format dataset directory from lists of token ids (a test's own corpus)."""
    return token_dataset(directory, docs, vocab, name, validation_fraction=fraction)


@pytest.fixture
def corpus(tmp_path):
    """40 documents of 5-60 tokens whose ids say where they are: token = 1 + (doc * 61 + offset) % 299."""
    rng = np.random.default_rng(1)
    docs = [[1 + (d * 61 + o) % 299 for o in range(int(rng.integers(5, 60)))] for d in range(40)]
    return docs, make_dataset(tmp_path / "corpus", docs, fraction=0.1)
