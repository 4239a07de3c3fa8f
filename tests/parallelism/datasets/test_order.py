"""The sample order's maths, against brute force: permutations, the split, packing."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism.datasets.order import (build_epoch, keyed_permutation, sample_spans, samples_per_epoch,
                                        split_documents, stream_key)


@given(st.integers(0, 3000), st.integers(0, 2**64 - 1))
def test_keyed_permutation_is_a_permutation_fixed_by_its_key(n, key):
    p = keyed_permutation(n, key)
    assert sorted(p.tolist()) == list(range(n))
    assert np.array_equal(p, keyed_permutation(n, key))


def _splitmix64(x: int) -> int:
    """Vigna's reference, in Python integers (the oracle for the vectorised numpy one)."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


@given(st.integers(1, 200), st.integers(0, 2**64 - 1))
def test_keyed_permutation_is_the_argsort_of_splitmix64(n, key):
    """The order is part of a run's identity: it is this written-out function, not a library's RNG."""
    expected = sorted(range(n), key=lambda i: (_splitmix64(i ^ key), i))
    assert keyed_permutation(n, key).tolist() == expected


def test_stream_key_is_pinned():
    """A changed key derivation silently reorders every run: bump ORDER_VERSION instead."""
    assert stream_key("fingerprint", 0) == int.from_bytes(
        __import__("hashlib").sha256(b"1/fingerprint/0").digest()[:8], "little")


@given(st.integers(1, 500), st.floats(0, 0.9), st.integers(0, 2**32))
def test_split_is_a_partition(documents, fraction, key):
    if fraction and max(1, round(fraction * documents)) >= documents:
        return
    train, held = split_documents(documents, fraction, key)
    assert sorted([*train.tolist(), *held.tolist()]) == list(range(documents))
    assert len(held) == (0 if fraction == 0 else max(1, round(fraction * documents)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 16), st.integers(0, 2**32))
def test_packing_matches_the_concatenated_stream(lengths, seq, key):
    """Brute force: sample j is the epoch stream's tokens [k*seq, k*seq + seq + 1), k = shuffle[j], and
    every position of the stream but the first is a target exactly once over the epoch."""
    ids = np.arange(100, 100 + len(lengths), dtype=np.int64)  # document ids need not start at 0
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    epoch = build_epoch(ids, lengths_arr, seq, key)
    by_id = dict(zip(ids.tolist(), lengths))
    stream = [(d, o) for d in epoch.documents.tolist() for o in range(by_id[d])]
    S = samples_per_epoch(sum(lengths), seq)
    assert len(epoch.shuffle) == S and sorted(epoch.shuffle.tolist()) == list(range(S))
    targets = []
    for j in range(S):
        flat = [(d, off + t) for d, off, n in sample_spans(epoch, j, seq) for t in range(n)]
        k = int(epoch.shuffle[j])
        assert flat == stream[k * seq: k * seq + seq + 1]
        targets += flat[1:]
    assert sorted(targets) == sorted(stream[1: S * seq + 1])
