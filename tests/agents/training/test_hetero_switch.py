"""Online switches of a multimodal job (tiny-vlm) between homogeneous and heterogeneous
layouts, on 4 gloo ranks: homogeneous -> non-colocated (the encoder moves onto ranks 0-1,
the LLM onto ranks 2-3) -> colocated (both modules back on all 4 ranks, different layouts).

State. At every switch each rank's handed-over shards (params and the three fp32 states of
both modules) are gathered into the full logical tensors, independently of the planner and
the engine; every shard the engine produces must equal its box of those tensors bit for
bit, and the engine's own digests (switch_state) must have matched.

Loss tolerance, as in test_parallel.py: switched and unswitched runs compute the same
global batch from the same state and differ only in reduction order (tp splits of bf16
matmuls, dp splits of fp32 gradient sums, the encoder's gradient summed per encoder rank).
The noise of one change of reduction order is measured (a 1-rank run against the
homogeneous 4-rank run, floor 1e-3 as in test_hetero.py); the switched run goes through
len(SWITCHES) + 1 layouts, so it may differ by that many times the noise. The step before
the first switch is the same program and must match exactly.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from agents.engine.launch import run_ranks
from agents.engine.shards import box_shape, rank_boxes
from agents.layout.catalog import get_model
from agents.layout.placement import place
from agents.layout.shards import b_dim
from agents.training import run as run_module
from agents.training.parallel import TrainConfig, TrainingError
from agents.training.run import Switch, check_layout, train_rank

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIG = TrainConfig(model="tiny-vlm", global_batch=8, seq_len=16, micro_batches=2, lr=3e-3)
START = "tp=2,dp=2"
SWITCHES = [Switch(1, "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3"),  # encoder onto its own ranks
            Switch(2, "encoder:dp=4;llm:tp=2,dp=2")]                 # and back, colocated
STEPS = 3


def _gather_full(spec, shards) -> dict:
    """Every rank's shards -> full logical tensors (numpy, by (tensor index, state)); replicas
    of one element must agree."""
    mine = [(k, s.box, s.data.float().numpy().copy()) for k, s in shards.items()]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict = {}
    for rank_shards in everyone:
        for (index, state), box, data in rank_shards:
            tensor = spec.tensors[index]
            target = full.setdefault((index, state), np.full(tensor.shape, np.nan, dtype=np.float32))
            region = _region(tensor, target, box)
            held = ~np.isnan(region)
            assert np.array_equal(region[held], data[held]), (tensor.name, state, "replicas differ")
            region[...] = data
    return full


def _region(tensor, array: np.ndarray, box) -> np.ndarray:
    index = [slice(None)] * array.ndim
    index[0] = slice(box[0], box[1])
    bd = b_dim(tensor)
    if bd is not None:
        index[bd] = slice(box[2], box[3])
    return array[tuple(index)]


def _switched_run(rank: int, world: int) -> dict:
    """train_rank with the real switch_state, wrapped to check every switch's state."""
    spec = get_model(CONFIG.model)
    checks: list[dict] = []
    real_switch_state = run_module.switch_state

    def checked_switch_state(spec_, shards, scalars, src, dst, rank_, **options):
        expected = rank_boxes(place(spec, src), rank_)
        boxes_ok = set(shards) == set(expected) and all(
            tuple(shards[k].data.shape) == box_shape(spec.tensors[k[0]], expected[k]) for k in expected)
        full = _gather_full(spec, shards)
        new, scalars, report = real_switch_state(spec_, shards, scalars, src, dst, rank_, **options)
        dst_boxes = rank_boxes(place(spec, dst), rank_)
        exact = set(new) == set(dst_boxes) and all(
            new[k].box == dst_boxes[k]
            and np.array_equal(new[k].data.float().numpy(), _region(spec.tensors[k[0]], full[k], new[k].box))
            for k in new)
        covered = all(not np.isnan(v).any() for v in full.values()) and len(full) == 4 * len(spec.tensors)
        checks.append({"boxes_ok": boxes_ok, "exact": exact, "covered": covered, "verified": report.verified,
                       "network_bytes": report.network_bytes, "modules": _modules_held(spec, new)})
        return new, scalars, report

    run_module.switch_state = checked_switch_state
    try:
        log = train_rank(rank, world, CONFIG, START, STEPS, SWITCHES, staging_bytes=64 * 1024)
    finally:
        run_module.switch_state = real_switch_state
    return {"losses": [s.loss for s in log.steps], "checks": checks}


def _modules_held(spec, shards) -> list[str]:
    return sorted({spec.tensors[index].split.module for index, _ in shards})


def _plain_run(rank: int, world: int, layout: str) -> list[float]:
    return [s.loss for s in train_rank(rank, world, CONFIG, layout, STEPS, []).steps]


@pytest.fixture(scope="module")
def runs() -> tuple:
    switched = run_ranks(4, _switched_run, timeout_s=240)
    unswitched = run_ranks(4, _plain_run, START, timeout_s=120)[0]
    single = run_ranks(1, _plain_run, "tp=1", timeout_s=120)[0]
    return switched, unswitched, single


def test_every_switch_keeps_every_state_tensor_bit_exact(runs) -> None:
    switched, _, _ = runs
    for rank, result in enumerate(switched):
        checks = result["checks"]
        assert len(checks) == len(SWITCHES)
        for check in checks:
            assert check["boxes_ok"] and check["covered"], (rank, check)
            assert check["exact"] and check["verified"], (rank, check)
            assert check["network_bytes"] > 0
        # Non-colocated: ranks 0-1 hold only the encoder, ranks 2-3 only the LLM; colocated
        # again afterwards: every rank holds both modules.
        assert checks[0]["modules"] == (["encoder"] if rank < 2 else ["llm"]), (rank, checks[0]["modules"])
        assert checks[1]["modules"] == ["encoder", "llm"]


def test_training_continues_across_the_switches(runs) -> None:
    switched, unswitched, single = runs
    losses = switched[0]["losses"]
    assert len(losses) == STEPS
    assert all(r["losses"] == losses for r in switched)  # every rank reports the global loss
    assert losses[0] == unswitched[0]  # before the first switch: the same program
    noise = max(abs(a - b) for a, b in zip(unswitched, single))
    allowed = (len(SWITCHES) + 1) * max(noise, 1e-3)
    for step, (a, b) in enumerate(zip(losses, unswitched)):
        assert abs(a - b) <= allowed, (step, a, b, noise)
    assert losses[0] > losses[1] > losses[2]  # and it learns
    print(f"noise {noise:.2e}; switched vs unswitched {[round(a - b, 6) for a, b in zip(losses, unswitched)]}")


def test_an_untrainable_switch_target_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(TrainingError, match="encoder: pp=2"):
        train_rank(0, 1, CONFIG, "tp=1", 3, [Switch(1, "encoder:pp=2;llm:pp=2")])
    with pytest.raises(TrainingError, match="llm: tp=4 exceeds the 2 kv heads"):
        check_layout(CONFIG, "encoder:dp=4;llm:tp=4")
