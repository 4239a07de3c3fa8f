"""TokenDataset: samples are what the documents say, a pure function of the index, whatever the batching."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from parallelism.datasets.dataset import CACHE_DIR, TokenDataset
from parallelism.datasets.errors import DatasetError
from parallelism.datasets.order import samples_per_epoch
from tests.parallelism.datasets.conftest import make_dataset


def _oracle(docs, data: TokenDataset, i: int):
    """Brute force: rebuild the epoch stream from the dataset's document order, cut sample i out of it."""
    part = data.parts[0]
    e, j = divmod(i, part.per_epoch)
    epoch = part.epoch(e)
    stream = [t for d in epoch.documents.tolist() for t in docs[d]]
    k = int(epoch.shuffle[j])
    return stream[k * data.seq_len: k * data.seq_len + data.seq_len + 1]


def test_samples_are_the_documents_tokens_across_epochs(corpus):
    docs, path = corpus
    data = TokenDataset(path, 16, seed=3)
    for i in [0, 1, 5, data.samples_per_epoch - 1, data.samples_per_epoch, 3 * data.samples_per_epoch + 7]:
        assert data.sample(i).tolist() == _oracle(docs, data, i)


def test_a_batch_does_not_depend_on_how_it_is_cut(corpus):
    _, path = corpus
    data = TokenDataset(path, 16, seed=3)
    tokens, targets = data.batch(40, 12)
    parts = [data.batch(40, 5), data.batch(45, 3), data.batch(48, 4)]
    assert torch.equal(tokens, torch.cat([p[0] for p in parts]))
    assert torch.equal(targets[:, :-1], tokens[:, 1:])


def test_order_depends_on_seed_and_is_rebuilt_identically_from_its_cache(corpus):
    _, path = corpus
    a = TokenDataset(path, 16, seed=3).batch(0, 8)[0]
    assert (path / CACHE_DIR).is_dir()
    assert torch.equal(TokenDataset(path, 16, seed=3).batch(0, 8)[0], a)  # read from the cache
    assert torch.equal(TokenDataset(path, 16, seed=3, cache=False).batch(0, 8)[0], a)  # built again
    assert not torch.equal(TokenDataset(path, 16, seed=4).batch(0, 8)[0], a)
    for f in (path / CACHE_DIR).iterdir():  # a torn cache: rebuilt, same order
        f.write_bytes(f.read_bytes()[:20])
    assert torch.equal(TokenDataset(path, 16, seed=3).batch(0, 8)[0], a)


def test_validation_split_holds_other_documents(corpus):
    docs, path = corpus
    train = TokenDataset(path, 8, split="train").parts[0]
    held = TokenDataset(path, 8, split="validation").parts[0]
    assert len(held.ids) == 4 and not set(held.ids.tolist()) & set(train.ids.tolist())
    assert held.per_epoch == samples_per_epoch(sum(len(docs[d]) for d in held.ids), 8)


def test_every_sample_id_of_an_epoch_once(corpus):
    _, path = corpus
    data = TokenDataset(path, 16, seed=0)
    S = data.samples_per_epoch
    ids = data.sample_ids(0, 2 * S)
    assert sorted(ids[:S].tolist()) == list(range(S)) and sorted(ids[S:].tolist()) == list(range(S, 2 * S))


def test_blend_reads_its_parts(tmp_path):
    a = make_dataset(tmp_path / "a", [[1] * 50 for _ in range(10)])
    b = make_dataset(tmp_path / "b", [[2] * 50 for _ in range(10)])
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "dataset.json").write_text(json.dumps({
        "version": 1, "format": "blend", "vocab_size": 300, "fingerprint": "blend-test",
        "parts": [{"path": "../a", "weight": 3}, {"path": str(b), "weight": 1}], "blend_period": 4}))
    data = TokenDataset(tmp_path / "mix", 10)
    first = [int(data.sample(i)[0]) for i in range(8)]
    assert first.count(1) == 6 and first.count(2) == 2
    ids = data.sample_ids(0, 8).tolist()
    assert len(set(ids)) == 8  # the parts' samples keep their own identities


def test_tokens_outside_the_vocab_are_refused_by_sample(tmp_path):
    make_dataset(tmp_path / "d", [[1, 2, 299, 4] * 10], vocab=200)
    with pytest.raises(DatasetError, match="holds token 299, outside the dataset's vocab of 200"):
        TokenDataset(tmp_path / "d", 8).batch(0, 4)


def test_bad_manifests_are_refused_by_key(tmp_path):
    path = make_dataset(tmp_path / "d", [[1, 2, 3] * 10])
    raw = json.loads((path / "dataset.json").read_text())

    def refused(**change):
        (path / "dataset.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(DatasetError) as info:
            TokenDataset(path, 4)
        return str(info.value)

    assert "format 'arrow' unknown" in refused(format="arrow")
    assert "vocab_size=0 must be an integer >= 1" in refused(vocab_size=0)
    assert "prefix='../x' must be a plain file name" in refused(prefix="../x")
    assert "validation_fraction=1.0 must be below 1" in refused(validation_fraction=1.0)
    (path / "dataset.json").write_text("{")
    with pytest.raises(DatasetError, match="d/dataset.json: not readable JSON"):
        TokenDataset(path, 4)
    (path / "dataset.json").write_text(json.dumps(raw))
    with pytest.raises(DatasetError, match="fewer than one sample of seq 4096"):
        TokenDataset(path, 4096)
