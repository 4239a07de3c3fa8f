"""Training on a dataset: every rank reads its slice of the global batch, and a layout switch
continues at the exact next sample, the same samples an unswitched run reads."""
from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from parallelism.datasets.dataset import TokenDataset
from parallelism.engine.launch import run_ranks
from parallelism.training.data import sample_digest
from parallelism.training.parallel import TrainConfig, TrainingError, check_trainable
from parallelism.layout.placement import place
from parallelism.training.run import Switch, train_rank
from tests.parallelism.datasets.conftest import make_dataset

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]
SEQ, BATCH = 16, 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = np.random.default_rng(5)
    docs = [rng.integers(1, 500, size=int(rng.integers(10, 90))).tolist() for _ in range(60)]
    return str(make_dataset(tmp_path_factory.mktemp("data") / "d", docs, vocab=500, fraction=0.05))


def _run(rank, world, config, layout, steps, switches):
    return [asdict(s) for s in train_rank(rank, world, config, layout, steps, switches).steps]


def _read(logs) -> dict[int, list[tuple[int, int, str]]]:
    """step -> the distinct (first sample, count, digest) the ranks read, in sample order."""
    out: dict[int, set] = {}
    for rank_steps in logs:
        for s in rank_steps:
            out.setdefault(s["step"], set()).add((s["first_sample"], s["samples"], s["sample_digest"]))
    return {step: sorted(v) for step, v in out.items()}


def test_a_switch_continues_at_the_next_sample_as_an_unswitched_run(dataset):
    config = TrainConfig(model="tiny-gpt", global_batch=BATCH, seq_len=SEQ, micro_batches=1, dataset=dataset,
                         total_steps=6)
    switched = _read(run_ranks(2, _run, config, "dp=2,zero=1", 6, [Switch(3, "tp=2,dp=1,zero=1")], timeout_s=200))
    plain = _read(run_ranks(1, _run, config, "dp=1", 6, [], timeout_s=200))
    data = TokenDataset(dataset, SEQ, config.seed)
    assert sorted(switched) == sorted(plain) == list(range(1, 7))
    for step in range(1, 7):
        reads = switched[step]
        # the ranks' slices tile the global batch exactly: no sample twice, none skipped
        covered = [i for first, n, _ in reads for i in range(first, first + n)]
        assert covered == list(range((step - 1) * BATCH, step * BATCH))
        assert len(reads) == (2 if step <= 3 else 1)
        for first, n, digest in reads:  # each rank read those samples' tokens
            assert digest == sample_digest(data, first, n)
        # the same samples as the unswitched run
        ids = np.concatenate([data.sample_ids(first, n) for first, n, _ in reads])
        ((first, n, _),) = plain[step]
        assert np.array_equal(ids, data.sample_ids(first, n))


def test_a_dataset_whose_vocab_exceeds_the_model_is_refused(tmp_path):
    big = make_dataset(tmp_path / "big", [[1, 2, 3] * 30], vocab=600)
    config = TrainConfig(model="tiny-gpt", seq_len=SEQ, dataset=str(big))
    with pytest.raises(TrainingError, match="vocab of 600 exceeds the model's 512"):
        check_trainable(config, place(config.tensors, "dp=1"))
    config = TrainConfig(model="tiny-vlm", seq_len=SEQ, dataset=str(big))
    from parallelism.training.run import check_layout
    with pytest.raises(TrainingError, match="multimodal"):
        check_layout(config, "dp=1")
