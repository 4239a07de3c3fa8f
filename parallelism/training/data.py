"""Deterministic synthetic training data addressed by sample index, with a resumable position.

Sample i is a pure function of (seed, i): `batch(position, n)` stacks samples position .. position+n-1.
So a batch does not depend on the batch size that came before, and a layout change can re-split the
same global batch over a different number of data-parallel ranks. Worked example: global batch 8 at
position 16 over dp=2 is `batch(16, 4)` on dp rank 0 and `batch(20, 4)` on dp rank 1; both ranks then
advance the shared position to 24, and after a switch to dp=4 rank 3 reads `batch(24 + 3*2, 2)`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor


def _generator(seed: int, stream: str, index: int = 0) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{stream}/{index}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _check_range(position: int, batch_size: int) -> None:
    if position < 0 or batch_size < 1:
        raise ValueError(f"need position >= 0 and batch_size >= 1, got position={position}, batch_size={batch_size}")


@dataclass(frozen=True, slots=True)
class DataPosition:
    """How many samples the run has consumed: the one data scalar a checkpoint or a layout switch carries."""

    samples: int = 0

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ValueError(f"DataPosition.samples must be >= 0, got {self.samples}")

    def advance(self, batch_size: int) -> DataPosition:
        return DataPosition(self.samples + batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    @classmethod
    def from_state_dict(cls, state: dict[str, int]) -> DataPosition:
        return cls(int(state["samples"]))


class SyntheticTokens:
    """Token sequences with a learnable pattern: each next token is perm[previous] (a fixed random permutation
    of the vocabulary), except with probability `noise` where it is uniformly random.

    A model that learns the permutation reaches about noise*ln(vocab) + H(1-noise) nats, far below the
    ln(vocab) of an untrained model, so the loss visibly goes down within a few dozen steps.
    """

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, noise: float = 0.1) -> None:
        if vocab < 2 or seq_len < 1 or not 0.0 <= noise <= 1.0:
            raise ValueError(f"need vocab >= 2, seq_len >= 1, 0 <= noise <= 1; got {vocab}, {seq_len}, {noise}")
        self.vocab, self.seq_len, self.seed, self.noise = vocab, seq_len, seed, noise
        self.perm = torch.randperm(vocab, generator=_generator(seed, "perm"))

    def _draws(self, index: int) -> tuple[Tensor, Tensor]:
        g = _generator(self.seed, "tokens", index)
        # The start token is the first "random" draw, so a whole sample costs two generator calls.
        randoms = torch.randint(self.vocab, (self.seq_len + 1,), generator=g)
        resets = torch.rand(self.seq_len + 1, generator=g) < self.noise
        return randoms, resets

    def batch(self, position: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """(tokens, targets), both int64 [batch_size, seq_len]; targets are tokens shifted left by one."""
        _check_range(position, batch_size)
        draws = [self._draws(position + i) for i in range(batch_size)]
        randoms = torch.stack([r for r, _ in draws])
        resets = torch.stack([m for _, m in draws])
        seq = torch.empty_like(randoms)
        seq[:, 0] = randoms[:, 0]
        # Sequential in time (each token depends on the previous), vectorized over the batch.
        for t in range(1, self.seq_len + 1):
            seq[:, t] = torch.where(resets[:, t], randoms[:, t], self.perm[seq[:, t - 1]])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class SyntheticImages:
    """Gaussian images [channels, image, image], one per sample index, for multimodal configs."""

    def __init__(self, channels: int, image: int, seed: int = 0) -> None:
        if channels < 1 or image < 1:
            raise ValueError(f"need channels >= 1 and image >= 1, got {channels}, {image}")
        self.channels, self.image, self.seed = channels, image, seed

    def batch(self, position: int, batch_size: int) -> Tensor:
        """float32 [batch_size, channels, image, image]."""
        _check_range(position, batch_size)
        shape = (self.channels, self.image, self.image)
        return torch.stack([torch.randn(shape, generator=_generator(self.seed, "images", position + i))
                            for i in range(batch_size)])


@lru_cache(maxsize=8)
def _dataset(directory: str, seq_len: int, seed: int, split: str):
    from parallelism.datasets.dataset import TokenDataset

    return TokenDataset(directory, seq_len, seed, split)


def training_data(config, split: str = "train"):
    """What a trainer reads `batch(position, n)` from: the config's dataset (one open copy per
    process and setting, so a switch reuses its memmaps and epoch index), else synthetic tokens."""
    if config.dataset is None:
        if split != "train":
            raise ValueError("synthetic data has no validation split")
        return SyntheticTokens(config.model_config.llm.vocab, config.seq_len, seed=config.seed)
    return _dataset(config.dataset, config.seq_len, config.seed, split)


def check_training_data(config) -> None:
    """Raise DatasetError (a ValueError naming the file and the rule) when the config's dataset
    cannot feed its model: unreadable, too small for one sample, or a vocab above the model's."""
    if config.dataset is None:
        return
    data = training_data(config)
    vocab = config.model_config.llm.vocab
    if data.vocab_size > vocab:
        from parallelism.datasets.errors import DatasetError

        raise DatasetError(f"{data.manifest.name}: its tokenizer's vocab of {data.vocab_size} exceeds the model's "
                           f"{vocab} ({config.model}): token ids past {vocab - 1} have no embedding row")


def sample_digest(data, first: int, count: int) -> str:
    """16 hex digits over the identities of samples first .. first + count - 1 (a dataset's
    `sample_ids`: where each sample's tokens lie; synthetic data: the indices themselves)."""
    ids = data.sample_ids(first, count) if hasattr(data, "sample_ids") else range(first, first + count)
    return hashlib.blake2b(b"".join(int(i).to_bytes(8, "little", signed=True) for i in ids),
                           digest_size=8).hexdigest()
