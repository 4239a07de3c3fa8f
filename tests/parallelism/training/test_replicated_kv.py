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

from parallelism.layout.catalog import get_model
from parallelism.training.kv_heads import is_replicated
from parallelism.training.parallel import TrainConfig
from parallelism.training.run import Switch
from tests.support.switched_training import check_switched_training
from tests.support.first_step import boxes_off_the_single_rank

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


def _replicated_heads(spec, shards) -> dict:
    return {(spec.tensors[i].name, state): s.data for (i, state), s in shards.items()
            if is_replicated(spec.tensors[i], 4)}


def test_switches_into_and_out_of_replicated_kv_heads_are_exact_verified_and_train_on(tmp_path) -> None:
    switched = check_switched_training(CONFIG, START, SWITCHES, STEPS, str(tmp_path), final=_replicated_heads)
    # The two TP ranks sharing a kv head hold bit-identical copies of it, after 8 steps and 3 switches.
    for a, b in ((0, 1), (2, 3)):
        assert switched[a]["final"].keys() == switched[b]["final"].keys() and switched[a]["final"]
        for key, value in switched[a]["final"].items():
            assert torch.equal(value, switched[b]["final"][key]), key
