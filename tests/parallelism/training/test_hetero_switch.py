"""Online switches of a multimodal job (tiny-vlm) between homogeneous and heterogeneous
layouts, on 4 gloo ranks: homogeneous -> non-colocated (the encoder moves onto ranks 0-1,
the LLM onto ranks 2-3) -> colocated (both modules back on all 4 ranks, different layouts);
and homogeneous -> a ZeRO layout where some ranks' chunks of a tensor are empty -> out of it.

State. At every switch each rank's handed-over shards (params and the three fp32 states of
both modules) are gathered into the full logical tensors, independently of the planner and
the engine; every shard the engine produces must equal its box of those tensors bit for
bit, and the engine's own digests (switch_state) must have matched.

Loss tolerance. The run starts on one rank (tp=1; ranks 1-3 wait), so its first step is
the same program as the reference run that never switches (the same 4 processes train it
first on tp=1 throughout) and must match exactly. After the switches the two compute the
same global batches from the same state and differ only in reduction order (tp splits of
bf16 matmuls, dp splits of fp32 gradient sums, the encoder's gradient summed per encoder
rank): test_hetero.py measures that noise between layouts at 4e-4 and bounds it by 1e-3;
the switched run has been on (switches + 1) layouts, so it may differ by that many
times 1e-3 (measured: 1.2e-4). A lost data position or optimizer step moves the loss by
the step-to-step change, 0.02-0.04 here. One process spawn per schedule for both runs keeps it fast.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch.distributed as dist

from parallelism.engine.launch import run_ranks
from parallelism.engine.shards import box_shape, rank_boxes
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.layout.shards import b_dim
from parallelism.training import run as run_module
from parallelism.training.parallel import TrainConfig, TrainingError
from parallelism.training.run import Switch, train_rank

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIG = TrainConfig(model="tiny-vlm", global_batch=8, seq_len=16, micro_batches=2, lr=3e-3)
START = "tp=1"
SCHEDULES = {
    "placements": [Switch(1, "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3"),  # grow 1 -> 4, encoder on its own ranks
                   Switch(2, "encoder:dp=4;llm:tp=2,dp=2")],                 # and back, colocated
    # Encoder ZeRO over more dp ranks than the class token has rows (1): ranks 1-3 hold an
    # empty encoder.cls_token chunk, which is no shard (docs/contracts.md section 3); into that
    # layout, then out of it onto other ranks.
    "empty-chunks": [Switch(1, "encoder:dp=4,zero=1;llm:tp=2,dp=2,zero=1"),
                     Switch(2, "encoder:dp=2,zero=1,ranks=0-1;llm:tp=2,zero=1,ranks=2-3")],
    # The LLM's 2 kv heads replicated over tp=4 (issue 29), then out onto its own 2 ranks.
    "kv-heads": [Switch(1, "encoder:dp=4;llm:tp=4"), Switch(2, "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3")],
    # Sequence parallelism (the LLM's 17 image + 17 text positions over its tp): into an SP
    # layout (llm tp=2 on its own ranks) and out of it (llm tp=1, where SP splits nothing).
    # SP moves no state box, only activations: what this adds is the trainer rebuilt under
    # SP from switched state, and back.
    "sequence-parallel": [Switch(1, "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3"),
                          Switch(2, "encoder:tp=2,dp=2;llm:dp=4")],
    # An interleaved LLM pipeline (pp=2 x vpp=2: pipeline rank 0 holds layers 0 and 2, rank
    # 1 layers 1 and 3, the planner's cut), then out of it onto the LLM's own 2 ranks.
    "interleaved": [Switch(1, "encoder:dp=4;llm:tp=2,pp=2,vpp=2"),
                    Switch(2, "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3")],
    # Context parallelism in the LLM (17 image + 15 text positions over cp=2: its state
    # replicated, or ZeRO-chunked, over dp x cp), then out of it onto the LLM's own 2 ranks.
    "context-parallel": [Switch(1, "encoder:dp=4,zero=1;llm:dp=2,cp=2,zero=1"),
                         Switch(2, "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3")],
    # zero=3 (FSDP2) in both modules (issue 29): into it (every state, the bf16 param too, cut
    # over dp), then out of it onto each module's own ranks with zero=1 / zero=0.
    "zero3": [Switch(1, "encoder:dp=4,zero=3;llm:tp=2,dp=2,zero=3"),
              Switch(2, "encoder:dp=2,zero=1,ranks=0-1;llm:tp=2,ranks=2-3")],
    # A tied embedding + head (tiny-vlm-tied): into llm tp=2, pp=2, where both end stages hold
    # it (the planner's first+last boxes), then out onto an unpipelined LLM.
    "tied-pp": [Switch(1, "encoder:dp=4;llm:tp=2,pp=2"), Switch(2, "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3")],
}
CONFIGS = {"sequence-parallel": replace(CONFIG, seq_len=17, sequence_parallel=True),  # others: CONFIG
           "context-parallel": replace(CONFIG, seq_len=15),
           "tied-pp": replace(CONFIG, model="tiny-vlm-tied")}
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


def _runs(rank: int, world: int, switches: list[Switch], config: TrainConfig) -> dict:
    """The reference that never switches, then train_rank with the real switch_state, wrapped
    to check every switch's state."""
    unswitched = [s.loss for s in train_rank(rank, world, config, START, STEPS, []).steps]
    spec = get_model(config.model)
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
        log = train_rank(rank, world, config, START, STEPS, switches, staging_bytes=64 * 1024)
    finally:
        run_module.switch_state = real_switch_state
    return {"losses": [s.loss for s in log.steps], "checks": checks, "unswitched": unswitched}


def _modules_held(spec, shards) -> list[str]:
    return sorted({spec.tensors[index].split.module for index, _ in shards})


def _modules_placed(layout: str, rank: int) -> list[str]:
    """The modules whose ranks include `rank`, read from the layout (not from any plan)."""
    placement = place(get_model(CONFIG.model), layout)
    return sorted(name for name, ml in placement.modules.items() if ml.offset <= rank < ml.offset + ml.world)


@pytest.fixture(scope="module", params=list(SCHEDULES))
def schedule(request) -> tuple[str, list[Switch], list[dict]]:
    switches = SCHEDULES[request.param]
    return request.param, switches, run_ranks(4, _runs, switches, CONFIGS.get(request.param, CONFIG), timeout_s=240)


def test_every_switch_keeps_every_state_tensor_bit_exact(schedule) -> None:
    name, switches, runs = schedule
    for rank, result in enumerate(runs):
        checks = result["checks"]
        assert len(checks) == len(switches)
        for switch, check in zip(switches, checks):
            assert check["boxes_ok"] and check["covered"], (name, rank, check)
            assert check["exact"] and check["verified"], (name, rank, check)
            assert check["network_bytes"] > 0
            # Non-colocated: ranks 0-1 hold only the encoder, ranks 2-3 only the LLM;
            # colocated: every rank holds both modules.
            assert check["modules"] == _modules_placed(switch.layout, rank), (name, rank, check["modules"])


def test_empty_chunks_are_no_shards() -> None:
    """The 'empty-chunks' schedule's first target does leave ranks without a chunk."""
    placement = place(get_model(CONFIG.model), SCHEDULES["empty-chunks"][0].layout)
    cls = next(i for i, t in enumerate(placement.model.tensors) if t.name == "encoder.cls_token")
    assert (cls, "master") in rank_boxes(placement, 0)
    for rank in (1, 2, 3):
        assert (cls, "param") in rank_boxes(placement, rank) and (cls, "master") not in rank_boxes(placement, rank)
        assert rank_boxes(placement, rank, keep_empty=True)[(cls, "master")][:2] == (1, 1)


def test_training_continues_across_the_switches(schedule) -> None:
    name, switches, runs = schedule
    losses, unswitched = runs[0]["losses"], runs[0]["unswitched"]
    assert len(losses) == len(unswitched) == STEPS
    # Rank 0 is in every layout; ranks 1-3 train from the first switch on, with the same losses.
    assert all(r["losses"] == losses[1:] for r in runs[1:])
    assert losses[0] == unswitched[0]  # before the first switch: the same program
    allowed = (len(switches) + 1) * 1e-3
    for step, (a, b) in enumerate(zip(losses, unswitched)):
        assert abs(a - b) <= allowed, (step, a, b)
    # seq 17's and 15's batches, the tied model: not monotone over 3 warmup steps (unswitched too)
    if name not in CONFIGS:
        assert losses[0] > losses[1] > losses[2]  # and it learns
    print(f"switched - unswitched: {[f'{a - b:.1e}' for a, b in zip(losses, unswitched)]}")


def test_an_untrainable_switch_target_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(TrainingError, match="encoder: pp=2"):
        train_rank(0, 1, CONFIG, "tp=1", 3, [Switch(1, "encoder:pp=2;llm:pp=2")])
