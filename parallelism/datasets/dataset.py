"""A dataset's split as training samples: `open_dataset(dir, seq_len, seed)` then
`batch(position, n)`, the same interface as the synthetic data (parallelism/training/data.py).

Sample i (`sample(i)`, seq_len + 1 tokens: inputs and the next-token targets) is a pure function of
(dataset fingerprint, seed, i) through order.py's epochs; each epoch's index is built once and
cached beside the data (`.order-cache/`, written atomically by whichever rank gets there first, so
no rank waits on another and a node with a private copy of the data builds its own).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from parallelism.datasets.blend import build_blend, locate
from parallelism.datasets.errors import DatasetError
from parallelism.datasets.indexed import IndexedDataset
from parallelism.datasets.manifest import Manifest, read_manifest
from parallelism.datasets.order import (EpochIndex, build_epoch, sample_spans, samples_per_epoch, split_documents,
                                        stream_key)
from parallelism.datasets.token_files import TokenFile

SPLITS = ("train", "validation")
CACHE_DIR = ".order-cache"


def split_key(manifest: Manifest) -> int:
    """The train/validation choice depends on the data alone, not a job's seed: every job on a
    dataset is validated on the same documents."""
    return stream_key(manifest.fingerprint, "split", manifest.validation_fraction)


class PackedSplit:
    """One (non-blend) dataset's split, packed into samples of seq_len + 1 tokens."""

    def __init__(self, manifest: Manifest, seq_len: int, seed: int, split: str, cache: bool = True) -> None:
        self.manifest, self.seq_len, self.seed, self.split = manifest, seq_len, seed, split
        if manifest.format == "megatron":
            data = IndexedDataset(manifest.directory / manifest.prefix)
            self.view = data.tokens_view
            self.doc_starts = data.pointers // data.dtype.itemsize
            self.doc_lengths = data.lengths.astype(np.int64)
        else:
            data = TokenFile(manifest.directory / manifest.file, manifest.token_dtype, manifest.header)
            self.view = data.tokens_view
            self.doc_starts = np.zeros(1, dtype=np.int64)
            self.doc_lengths = np.asarray([data.tokens], dtype=np.int64)
        train, held = split_documents(len(self.doc_lengths), manifest.validation_fraction, split_key(manifest))
        self.ids = train if split == "train" else held
        if split == "validation" and not len(held):
            raise DatasetError(f"{manifest.name}: has no validation split (validation_fraction 0)")
        self.per_epoch = samples_per_epoch(int(self.doc_lengths[self.ids].sum()), seq_len)
        if self.per_epoch < 1:
            raise DatasetError(f"{manifest.name}: its {split} split holds {int(self.doc_lengths[self.ids].sum())} "
                               f"tokens, fewer than one sample of seq {seq_len} + 1")
        self.cache_dir = manifest.directory / CACHE_DIR if cache else None
        self._epochs: OrderedDict[int, EpochIndex] = OrderedDict()
        self._lock = threading.Lock()
        self._ahead: dict[int, threading.Thread] = {}

    def epoch_key(self, epoch: int) -> int:
        return stream_key(self.manifest.fingerprint, self.split, self.manifest.validation_fraction, self.seq_len,
                          self.seed, epoch)

    def epoch(self, e: int) -> EpochIndex:
        with self._lock:
            if e in self._epochs:
                self._epochs.move_to_end(e)
                return self._epochs[e]
            ahead = self._ahead.get(e)
        if ahead is not None:
            ahead.join()
        index = self._built(e)
        with self._lock:
            self._epochs[e] = index
            while len(self._epochs) > 3:  # this epoch, the one a batch may straddle into, the prefetched one
                self._epochs.popitem(last=False)
        return index

    def _built(self, e: int) -> EpochIndex:
        key = self.epoch_key(e)
        index = self._load(key)
        if index is None:
            index = build_epoch(self.ids, self.doc_lengths[self.ids], self.seq_len, key)
            self._store(key, index)
        return index

    def prefetch(self, e: int) -> None:
        """Build (or load) epoch e in a background thread: a large dataset's next epoch index
        (an argsort over every sample) is ready before the boundary, so no step waits for it."""
        with self._lock:
            if e in self._epochs or e in self._ahead:
                return

            def run() -> None:
                index = self._built(e)
                with self._lock:
                    self._epochs[e] = index

            thread = self._ahead[e] = threading.Thread(target=run, name=f"epoch-{e}", daemon=True)
        thread.start()

    def _paths(self, key: int) -> dict[str, Path]:
        assert self.cache_dir is not None
        return {name: self.cache_dir / f"{key:016x}-{name}.npy" for name in ("documents", "starts", "shuffle")}

    def _load(self, key: int) -> EpochIndex | None:
        if self.cache_dir is None:
            return None
        paths = self._paths(key)
        if not all(p.is_file() for p in paths.values()):
            return None
        try:
            arrays = {name: np.load(p, mmap_mode="r") for name, p in paths.items()}
        except (OSError, ValueError):
            return None  # a torn cache file: rebuild (the order is a pure function, the cache only saves time)
        if len(arrays["shuffle"]) != self.per_epoch or len(arrays["starts"]) != len(self.ids) + 1:
            return None
        return EpochIndex(**arrays)

    def _store(self, key: int, index: EpochIndex) -> None:
        if self.cache_dir is None:
            return
        try:
            self.cache_dir.mkdir(exist_ok=True)
            for name, path in self._paths(key).items():
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, getattr(index, name))
                os.replace(tmp, path)
        except OSError:
            pass  # read-only data root: keep the index in memory

    def sample(self, i: int) -> np.ndarray:
        e, j = divmod(i, self.per_epoch)
        if 2 * j >= self.per_epoch:
            self.prefetch(e + 1)
        pieces = [self.view[self.doc_starts[d] + off: self.doc_starts[d] + off + n]
                  for d, off, n in sample_spans(self.epoch(e), j, self.seq_len)]
        return np.concatenate(pieces).astype(np.int64)

    def sample_id(self, i: int) -> int:
        """Where sample i's tokens start in its epoch's stream, tagged with the epoch: equal ids, equal tokens."""
        e, j = divmod(i, self.per_epoch)
        return e * self.per_epoch + int(self.epoch(e).shuffle[j])


class TokenDataset:
    """A dataset directory's split (or a blend of several) as `batch(position, n)`."""

    def __init__(self, directory: str | os.PathLike, seq_len: int, seed: int = 0, split: str = "train",
                 cache: bool = True) -> None:
        if split not in SPLITS:
            raise DatasetError(f"split {split!r} unknown ({', '.join(SPLITS)})")
        if seq_len < 1:
            raise DatasetError(f"seq_len {seq_len} must be >= 1")
        self.manifest = read_manifest(directory)
        self.seq_len, self.seed, self.split = seq_len, seed, split
        self.vocab_size = self.manifest.vocab_size
        if self.manifest.format == "blend":
            self.parts = [PackedSplit(self._part(p.path), seq_len, seed, split, cache) for p in self.manifest.parts]
            self.blend = build_blend([p.weight for p in self.manifest.parts], self.manifest.blend_period)
        else:
            self.parts = [PackedSplit(self.manifest, seq_len, seed, split, cache)]
            self.blend = None

    def _part(self, path: Path) -> Manifest:
        part = read_manifest(path)
        if part.format == "blend":
            raise DatasetError(f"{self.manifest.name}: part {path.name} is itself a blend (blends hold datasets)")
        if part.vocab_size > self.manifest.vocab_size:
            raise DatasetError(f"{self.manifest.name}: part {part.name} has vocab {part.vocab_size}, above the "
                               f"blend's {self.manifest.vocab_size}")
        return part

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    def _where(self, i: int) -> tuple[int, int]:
        return locate(self.blend, i) if self.blend is not None else (0, i)

    def sample(self, i: int) -> np.ndarray:
        if i < 0:
            raise DatasetError(f"sample index {i} must be >= 0")
        k, local = self._where(i)
        tokens = self.parts[k].sample(local)
        top = int(tokens.max())
        if top >= self.vocab_size:
            raise DatasetError(f"{self.parts[k].manifest.name}: sample {i} holds token {top}, outside the "
                               f"dataset's vocab of {self.vocab_size}")
        return tokens

    def sample_ids(self, position: int, n: int) -> np.ndarray:
        """Stable identities of samples position..position+n-1 (part in the top bits for a blend)."""
        out = np.empty(n, dtype=np.int64)
        for m in range(n):
            k, local = self._where(position + m)
            out[m] = (k << 56) | self.parts[k].sample_id(local)
        return out

    def batch(self, position: int, batch_size: int):
        """(tokens, targets), int64 tensors [batch_size, seq_len]: samples position .. position + batch_size - 1.
        (torch is imported here, not by the module: the control plane describes datasets without it.)"""
        import torch

        if position < 0 or batch_size < 1:
            raise DatasetError(f"need position >= 0 and batch_size >= 1, got {position}, {batch_size}")
        rows = torch.from_numpy(np.stack([self.sample(position + m) for m in range(batch_size)]))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    @property
    def samples_per_epoch(self) -> int:
        if self.blend is None:
            return self.parts[0].per_epoch
        # the blend's "epoch": when its most-used part (relative to its size) has been read once
        return min(int(p.per_epoch * len(self.blend.part) / c) for p, c in zip(self.parts, self.blend.counts))


def open_dataset(directory: str | os.PathLike, seq_len: int, seed: int = 0, split: str = "train") -> TokenDataset:
    return TokenDataset(directory, seq_len, seed, split)
