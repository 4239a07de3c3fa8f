"""Synthetic data: a batch is a pure function of (seed, position, size), and the position survives a save/restore."""
from __future__ import annotations

import pytest
import torch

from parallelism.training.data import DataPosition, SyntheticImages, SyntheticTokens


def test_tokens_are_deterministic_per_position_and_differ_across_positions() -> None:
    a, b = SyntheticTokens(512, 32, seed=4), SyntheticTokens(512, 32, seed=4)  # as two processes would
    x, y = a.batch(40, 4)
    x2, y2 = b.batch(40, 4)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(a.batch(44, 4)[0], x)
    assert not torch.equal(SyntheticTokens(512, 32, seed=5).batch(40, 4)[0], x)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert int(x.min()) >= 0 and int(x.max()) < 512


def test_a_batch_is_its_samples_so_it_can_be_resplit() -> None:
    data = SyntheticTokens(100, 16, seed=0)
    whole = data.batch(8, 6)
    halves = [data.batch(8, 3), data.batch(11, 3)]  # dp=2 reading the same global batch
    assert torch.equal(whole[0], torch.cat([h[0] for h in halves]))
    assert torch.equal(whole[1], torch.cat([h[1] for h in halves]))


def test_tokens_follow_the_permutation_except_for_noise() -> None:
    data = SyntheticTokens(512, 64, seed=2, noise=0.1)
    x, y = data.batch(0, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    follows = (data.perm[x] == y).float().mean().item()
    assert 0.85 < follows < 0.95  # 90% follow the pattern, plus the rare random draw that matches it


def test_images_are_deterministic_per_position() -> None:
    a, b = SyntheticImages(3, 16, seed=1), SyntheticImages(3, 16, seed=1)
    assert torch.equal(a.batch(5, 2), b.batch(5, 2))
    assert torch.equal(a.batch(5, 2)[1], a.batch(6, 1)[0])
    assert not torch.equal(a.batch(5, 2), a.batch(7, 2))
    assert a.batch(0, 2).shape == (2, 3, 16, 16)


def test_data_position_round_trips_and_validates() -> None:
    pos = DataPosition().advance(8).advance(8)
    assert pos == DataPosition(16)
    assert DataPosition.from_state_dict(pos.state_dict()) == pos
    with pytest.raises(ValueError, match=">= 0"):
        DataPosition(-1)
    with pytest.raises(ValueError, match="batch_size"):
        SyntheticTokens(10, 4).batch(0, 0)
