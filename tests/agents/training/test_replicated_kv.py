"""Grouped-query attention with fewer kv heads than tp (issue 29): tiny-gpt's 2 kv heads under
tp=4, each kv head replicated on the 2 TP ranks whose query heads use it, on real gloo
process groups.

The oracle is a single-rank run: after one step Adam's first moment is (1 - beta1) x the
gradient, so every rank's box of it, the replicated k/v heads' included, must equal the
same box of the single-rank gradient. Leaving out either sum the replication needs (the
k/v weights' over the ranks sharing a head, the attention input's over tp) puts k/v, or
every earlier tensor, off by O(1). Then online switches tp=4 <-> tp=2,dp=2 (and ZeRO-3),
bit-exact against the checkpoint path, verified, with training going on as an unswitched
run does and the replicas of each head equal.
"""
from __future__ import annotations

import pytest
import torch

from agents.engine.launch import run_ranks
from agents.layout.catalog import get_model
from agents.layout.placement import place
from agents.training.kv_heads import is_replicated
from agents.training.parallel import ParallelTrainer, TrainConfig, initial_shards
from agents.training.run import Switch, train_rank
from tests.support.first_step import boxes_off_the_single_rank, switch_against_the_checkpoint_path

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIG = TrainConfig(model="tiny-gpt", global_batch=8, seq_len=16, micro_batches=2, lr=3e-3)
START = "tp=4,zero=1"
SWITCHES = [Switch(2, "tp=2,dp=2,zero=1"), Switch(4, "tp=4,zero=3"), Switch(6, START)]
STEPS = 8


def test_tiny_gpt_has_fewer_kv_heads_than_the_tp_under_test() -> None:
    spec = get_model(CONFIG.model)
    assert spec.module("llm").num_kv_heads == 2
    replicated = {t.name.rsplit(".", 2)[-2] for t in spec.tensors if is_replicated(t, 4)}
    assert replicated == {"k", "v"}  # the query heads (4) are not replicated


@pytest.mark.parametrize("layout,world", [("tp=4,zero=1", 4), ("tp=4,zero=3", 4), ("tp=4,pp=2,zero=1", 8)])
def test_gradients_match_a_single_rank(layout: str, world: int) -> None:
    off, checked = boxes_off_the_single_rank(CONFIG, layout, world)
    assert off == []
    spec = get_model(CONFIG.model)
    replicated = [i for i, t in enumerate(spec.tensors) if is_replicated(t, 4)]
    assert all(checked.count(i) == 4 for i in replicated)  # every TP rank checked its copy of its head


def test_sequence_parallel_gradients_match_a_single_rank() -> None:
    config = TrainConfig(model="tiny-gpt", global_batch=8, seq_len=16, micro_batches=2, sequence_parallel=True)
    off, _ = boxes_off_the_single_rank(config, "tp=4,zero=1", 4)
    assert off == []


def _switched_run(rank: int, world: int, folder: str) -> dict:
    spec = get_model(CONFIG.model)
    layout = START
    trainer = ParallelTrainer(CONFIG, layout, rank, initial_shards(place(spec, layout), rank,
                                                                   CONFIG.seed))
    pending = {s.step: s.layout for s in SWITCHES}
    losses, reports = [], []
    for step in range(STEPS):
        if step in pending:
            shards, scalars = trainer.hand_over()
            new, scalars, report = switch_against_the_checkpoint_path(spec, shards, scalars, layout, pending[step],
                                                                      rank, f"{folder}/step{step}")
            reports.append(report.verified)
            layout = pending[step]
            trainer = ParallelTrainer(CONFIG, layout, rank, new, scalars)
        result = trainer.step()
        losses.append(None if result is None else result.loss)
    shards, _ = trainer.hand_over()
    heads = {(spec.tensors[i].name, state): s.data for (i, state), s in shards.items()
             if is_replicated(spec.tensors[i], 4)}
    return {"losses": losses, "reports": reports, "heads": heads}


def _plain_run(rank: int, world: int, layout: str) -> list[float]:
    return [s.loss for s in train_rank(rank, world, CONFIG, layout, STEPS, []).steps]


def test_switches_into_and_out_of_replicated_kv_heads_are_exact_verified_and_train_on(tmp_path) -> None:
    switched = run_ranks(4, _switched_run, str(tmp_path), timeout_s=280)
    unswitched = run_ranks(4, _plain_run, START, timeout_s=200)[0]
    other_layout = run_ranks(1, _plain_run, "tp=1,pp=1,dp=1,zero=0", timeout_s=120)[0]
    assert all(all(r["reports"]) and len(r["reports"]) == len(SWITCHES) for r in switched)
    # The two TP ranks sharing a kv head hold bit-identical copies of it, after 8 steps and 3 switches.
    for a, b in ((0, 1), (2, 3)):
        assert switched[a]["heads"].keys() == switched[b]["heads"].keys() and switched[a]["heads"]
        for key, value in switched[a]["heads"].items():
            assert torch.equal(value, switched[b]["heads"][key]), key
    losses = switched[0]["losses"]
    assert losses[:2] == unswitched[:2]  # before the first switch: the same program
    noise = max(abs(a - b) for a, b in zip(unswitched, other_layout))
    assert 0 < noise < 5e-3, noise
    for step, (a, b) in enumerate(zip(losses, unswitched)):
        assert abs(a - b) <= (len(SWITCHES) + 1) * noise, (step, a, b, noise)
    assert losses[-1] < losses[0] - 0.05  # and it learns
