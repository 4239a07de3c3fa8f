"""hf_initial_shards on real ranks (run_ranks, gloo): each rank of a layout reads exactly the
boxes it holds (its keys and boxes are rank_boxes'), and the boxes of all ranks put together
are the checkpoint's tensors bit for bit (masters fp32, params their bf16 cast, moments 0), for
tensor, pipeline, data (ZeRO-1 and ZeRO-3) and expert parallel layouts. A tensor-parallel
ParallelTrainer built from the shards computes transformers' logits (bf16 tolerance of
test_logits.py, on the positions routed as in fp32)."""
from __future__ import annotations

import pytest
import torch

from parallelism.engine.launch import run_ranks
from parallelism.engine.shards import box_shape, rank_boxes
from parallelism.hf_weights import assemble, hf_initial_shards, hf_model_config, read_hf_tensors
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from tests.parallelism.hf_weights.test_logits import check_bf16
from tests.parallelism.hf_weights.tiny_hf import hf_logits, pack, tokens, unpack

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

FORWARD = "tp=2,pp=1,dp=1,zero=1"
LAYOUTS = {
    "llama": [FORWARD, "tp=1,pp=2,dp=1,zero=1", "tp=1,pp=1,dp=2,zero=3"],
    "qwen3": [FORWARD, "tp=1,pp=2,dp=1,zero=0"],  # tied: the embedding on both end stages
    "mixtral": [FORWARD, "tp=1,pp=1,dp=2,ep=2,zero=1"],
    "qwen3_moe": [FORWARD, "tp=1,pp=2,dp=1,zero=1"],
    "gpt2": [FORWARD, "tp=1,pp=1,dp=2,zero=1"],
}


def _load(rank: int, world: int, path: str, layouts: list[str]) -> bytes:
    from parallelism.training.parallel import ParallelTrainer, TrainConfig

    model = get_model(path)
    loaded = {layout: hf_initial_shards(place(model, layout), rank, path) for layout in layouts}
    trainer = ParallelTrainer(TrainConfig(model=path, global_batch=2, seq_len=16, micro_batches=1), FORWARD, rank,
                              hf_initial_shards(place(model, FORWARD), rank, path))
    with torch.no_grad():
        logits = trainer.stage(tokens()).float()
    return pack((loaded, logits))


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_ranks_read_their_boxes(hf_dir, case: str) -> None:
    path = hf_dir(case)
    results = [unpack(r) for r in run_ranks(2, _load, path, LAYOUTS[case], timeout_s=240)]
    model = get_model(path)
    stored = read_hf_tensors(path, dtype=None)
    for layout in LAYOUTS[case]:
        placement = place(model, layout)
        every = []
        for rank, (loaded, _) in enumerate(results):
            shards = loaded[layout]
            expected = rank_boxes(placement, rank)
            assert {k: s.box for k, s in shards.items()} == expected, (layout, rank)
            assert all(tuple(s.data.shape) == box_shape(s.tensor, s.box) for s in shards.values())
            every += shards.values()
        masters, params = assemble(model, every, "master"), assemble(model, every, "param")
        for name, value in stored.items():
            assert torch.equal(masters[name], value.float()), (layout, name)
            assert torch.equal(params[name], value.float().bfloat16()), (layout, name)
        assert all(not s.data.any() for s in every if s.state.startswith("exp_avg"))
    x = tokens()
    ref = hf_logits(path, x)
    config, whole = hf_model_config(path), read_hf_tensors(path)
    for _, logits in results:  # every TP rank returns the whole logits
        check_bf16(config, whole, logits, ref, x)


@pytest.mark.parametrize("case", ["llama", "llama-bf16", "gpt2"])
def test_each_box_owns_exactly_its_memory(hf_dir, case: str) -> None:
    # A master (a ZeRO chunk inside the TP box read) once was a view of the whole fp32 box,
    # and a whole-tensor box of an fp32 file a view of the memory-mapped file: each kept
    # more memory alive than it holds, for the whole run (the trainer adopts them as they are).
    path = hf_dir(case)
    placement = place(get_model(path), "tp=2,dp=2,zero=1")
    stored = read_hf_tensors(path, dtype=None)
    every = []
    for rank in range(placement.world):
        for shard in hf_initial_shards(placement, rank, path).values():
            data = shard.data
            assert data.is_contiguous() and data.storage_offset() == 0, (rank, shard.tensor.name, shard.state)
            assert data.untyped_storage().nbytes() == data.numel() * data.element_size(), (rank, shard.tensor.name)
            every.append(shard)
    model = placement.model
    masters, params = assemble(model, every, "master"), assemble(model, every, "param")
    for name, value in stored.items():
        assert torch.equal(masters[name], value.float()) and torch.equal(params[name], value.float().bfloat16())


def test_an_f16_value_becomes_the_bf16_cast_of_its_fp32_master() -> None:
    from parallelism.hf_weights.load import cast_copy

    f16 = (torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 3).half()
    assert torch.equal(cast_copy(f16, torch.bfloat16), f16.float().bfloat16())
    assert torch.equal(cast_copy(f16, torch.float32), f16.float())
