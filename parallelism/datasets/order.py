"""The sample order of a run: a pure function of (dataset fingerprint, seed, sample index).

Megatron's GPTDataset is the reference design: per epoch, a shuffled document order, the
documents packed back to back into samples of seq_len + 1 tokens (consecutive samples share one
token, so every token is a target once), and a shuffled sample order. Two differences:
- The permutations are argsorts of a keyed 64-bit hash (splitmix64) of each position, written out
  here, not numpy's RNG, so the order does not depend on a numpy version, and epochs are built one
  at a time (an endless run needs no total sample count up front).
- The train/validation split is a keyed choice of documents (`split_documents`), so it does not
  depend on the order documents were written in.
Global sample i is sample i % S of epoch i // S (S samples per epoch). A job's whole data state is
how many samples it consumed; every layout reads the same samples for the same global batch.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from parallelism.datasets.errors import DatasetError

ORDER_VERSION = 1  # part of every key: a change of this algorithm must never reuse an old cache


def stream_key(*parts: object) -> int:
    """A 64-bit key for one named stream (fingerprint, seed, purpose, epoch...)."""
    text = "/".join(str(p) for p in (ORDER_VERSION, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vigna's splitmix64 finaliser over uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def keyed_permutation(n: int, key: int) -> np.ndarray:
    """A permutation of 0..n-1 determined by `key` alone (int64)."""
    hashes = splitmix64(np.arange(n, dtype=np.uint64) ^ np.uint64(key))
    return np.argsort(hashes, kind="stable").astype(np.int64)


def split_documents(documents: int, validation_fraction: float, key: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, validation ids), each sorted: round(fraction * documents) documents chosen by `key`
    for validation (at least one when the fraction is above 0), the rest for training."""
    if not 0.0 <= validation_fraction < 1.0:
        raise DatasetError(f"validation fraction {validation_fraction} must be in [0, 1)")
    held = 0 if validation_fraction == 0 else max(1, round(validation_fraction * documents))
    if validation_fraction and held >= documents:
        raise DatasetError(f"a validation fraction of {validation_fraction} leaves none of the {documents} "
                           "documents for training: give more documents or a smaller fraction")
    chosen = keyed_permutation(documents, key)
    return np.sort(chosen[held:]), np.sort(chosen[:held])


@dataclass(frozen=True)
class EpochIndex:
    """One epoch: the document order, the token offset where each ordered document starts (plus the
    total at the end), and the sample order. Sample j of the epoch reads the epoch stream's tokens
    [k * seq_len, k * seq_len + seq_len + 1) with k = shuffle[j]."""

    documents: np.ndarray  # int64 [D]: document ids in this epoch's order
    starts: np.ndarray     # int64 [D + 1]
    shuffle: np.ndarray    # int64 [S]


def samples_per_epoch(tokens: int, seq_len: int) -> int:
    return max(0, (tokens - 1) // seq_len)


def build_epoch(document_ids: np.ndarray, lengths: np.ndarray, seq_len: int, key: int) -> EpochIndex:
    """The epoch keyed by `key` over `document_ids` (whose token counts are `lengths`, same order)."""
    order = keyed_permutation(len(document_ids), stream_key(key, "documents"))
    ordered = document_ids[order]
    starts = np.zeros(len(ordered) + 1, dtype=np.int64)
    np.cumsum(lengths[order], out=starts[1:])
    samples = samples_per_epoch(int(starts[-1]), seq_len)
    return EpochIndex(ordered, starts, keyed_permutation(samples, stream_key(key, "samples")))


def sample_spans(epoch: EpochIndex, j: int, seq_len: int) -> list[tuple[int, int, int]]:
    """Sample j's seq_len + 1 tokens as (document id, offset, count) pieces, in order."""
    start = int(epoch.shuffle[j]) * seq_len
    need, out = seq_len + 1, []
    d = int(np.searchsorted(epoch.starts, start, side="right")) - 1
    offset = start - int(epoch.starts[d])
    while need:
        length = int(epoch.starts[d + 1] - epoch.starts[d])
        take = min(need, length - offset)
        if take > 0:
            out.append((int(epoch.documents[d]), offset, take))
            need -= take
        d, offset = d + 1, 0
    return out
