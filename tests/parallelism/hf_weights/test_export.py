"""Export: HF -> dynaplane -> HF at the source dtype, untrained, is byte-identical (same files,
same index, same tensor bytes, same config.json) whether the tensors come whole, from one of the
project's DCP checkpoints or from a running trainer's hand_over() shards; a trained model's
export loads in transformers with our model's logits; catalog models (no source) export with a
generated config.json that transformers reads into the same model."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from parallelism.engine.launch import run_ranks
from parallelism.hf_weights import (assemble, export_hf, export_hf_from_checkpoint, export_hf_from_shards,
                                    hf_initial_shards, hf_model_config, read_hf_tensors)
from parallelism.hf_weights.export import COMPANION_FILES
from parallelism.hf_weights.hf_files import INDEX
from parallelism.layout.catalog import get_config, get_model, model_from_config
from parallelism.layout.model_config import DecoderConfig, ModelConfig
from parallelism.layout.placement import place
from parallelism.training.init import initial_value
from tests.parallelism.hf_weights.test_logits import FP32_ATOL
from tests.parallelism.hf_weights.tiny_hf import hf_logits, our_logits, pack, tokens, unpack

WHOLE = "tp=1,pp=1,dp=1,zero=0"


def weights(folder: str) -> dict[str, tuple[str, torch.Tensor]]:
    """HF name -> (file, tensor) of every safetensors file in `folder`."""
    out = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            out.update({k: (file, f.get_tensor(k)) for k in f.keys()})
    return out


def assert_byte_identical(source: str, exported: str) -> None:
    a, b = weights(source), weights(exported)
    assert sorted(a) == sorted(b)
    for name, (file, tensor) in a.items():
        other_file, other = b[name]
        assert file == other_file, name  # the source's file split is kept
        assert tensor.dtype == other.dtype and tensor.shape == other.shape, name
        assert torch.equal(tensor.view(torch.uint8), other.view(torch.uint8)), name
    if os.path.exists(os.path.join(source, INDEX)):
        index = [json.loads(Path(folder, INDEX).read_text())["weight_map"] for folder in (source, exported)]
        assert index[0] == index[1]
    else:
        assert not os.path.exists(os.path.join(exported, INDEX))
    assert Path(source, "config.json").read_bytes() == Path(exported, "config.json").read_bytes()
    for name in COMPANION_FILES:  # generation_config.json, tokenizer files: copied unchanged
        if Path(source, name).exists():
            assert Path(source, name).read_bytes() == Path(exported, name).read_bytes()


def masters_of(path: str) -> dict[str, torch.Tensor]:
    placement = place(get_model(path), WHOLE)
    return assemble(placement.model, hf_initial_shards(placement, 0, path).values())


@pytest.mark.parametrize("case", ["llama", "llama-bf16", "qwen3", "mixtral", "mixtral-fused", "qwen3_moe", "gpt2"])
def test_whole_tensors_round_trip_byte_identical(hf_dir, tmp_path: Path, case: str) -> None:
    path = hf_dir(case)
    out = str(tmp_path / "out")
    export_hf(out, masters_of(path), source_dir=path)
    assert_byte_identical(path, out)
    x = tokens()
    assert torch.equal(hf_logits(out, x), hf_logits(path, x))


def test_a_changed_tensor_is_not_byte_identical(hf_dir, tmp_path: Path) -> None:
    """The byte comparison catches one element changed by one bf16 step."""
    path = hf_dir("llama-bf16")
    masters = masters_of(path)
    name = "llm.layers.1.attn.k.weight"
    value = masters[name].bfloat16()
    value.view(torch.int16)[0, 0] += 1
    masters[name] = value.float()
    export_hf(str(tmp_path / "out"), masters, source_dir=path)
    with pytest.raises(AssertionError):
        assert_byte_identical(path, str(tmp_path / "out"))


def _checkpoint(rank: int, world: int, path: str, layout: str, folder: str) -> None:
    """Save the loaded shards as agents/runtime/checkpoints.py's Checkpointer does."""
    import torch.distributed.checkpoint as dcp

    from parallelism.engine.checkpoint import layout_meshes, to_dtensors

    placement = place(get_model(path), layout)
    shards = hf_initial_shards(placement, rank, path)
    dcp.save(to_dtensors(placement, rank, shards, layout_meshes(placement)), checkpoint_id=folder)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "layout"), [("llama", "tp=2,pp=1,dp=1,zero=1"),
                                              ("mixtral", "tp=1,pp=1,dp=2,ep=2,zero=1")])
def test_from_checkpoint(hf_dir, tmp_path: Path, case: str, layout: str) -> None:
    path = hf_dir(case)
    checkpoint = str(tmp_path / "step-00000000-0")
    run_ranks(2, _checkpoint, path, layout, checkpoint, timeout_s=240)
    out = str(tmp_path / "out")
    export_hf_from_checkpoint(checkpoint, out, source_dir=path)
    assert_byte_identical(path, out)
    # No source: the model's config (what a TrainConfig resolves), bf16 unless asked, a generated config.json.
    generated = str(tmp_path / "generated")
    export_hf_from_checkpoint(checkpoint, generated, config=hf_model_config(path), dtype=torch.float32)
    x = tokens()
    assert (hf_logits(generated, x) - hf_logits(path, x)).abs().max() <= FP32_ATOL


def _train_and_export(rank: int, world: int, path: str, layout: str, untouched: str, trained: str) -> bytes:
    from parallelism.training.parallel import ParallelTrainer, TrainConfig

    config = TrainConfig(model=path, global_batch=4, seq_len=16, micro_batches=2, lr=1e-2)
    placement = place(config.tensors, layout)
    trainer = ParallelTrainer(config, layout, rank, hf_initial_shards(placement, rank, path))
    shards, scalars = trainer.hand_over()
    export_hf_from_shards(placement, rank, shards, untouched, source_dir=path)
    trainer = ParallelTrainer(config, layout, rank, shards, scalars)
    trainer.step()
    shards, _ = trainer.hand_over()
    export_hf_from_shards(placement, rank, shards, trained, config=config.model_config, dtype=torch.float32)
    return pack([s for s in shards.values() if s.state == "master"])


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "layout"), [("gpt2", "tp=1,pp=2,dp=1,zero=1"), ("qwen3", "tp=2,pp=1,dp=1,zero=0")])
def test_from_a_trainers_shards(hf_dir, tmp_path: Path, case: str, layout: str) -> None:
    path = hf_dir(case)
    untouched, trained = str(tmp_path / "untouched"), str(tmp_path / "trained")
    results = run_ranks(2, _train_and_export, path, layout, untouched, trained, timeout_s=240)
    assert_byte_identical(path, untouched)
    assert not os.path.exists(untouched + ".masters")  # the scratch checkpoint is gone
    masters = assemble(get_model(path), [s for r in results for s in unpack(r)])
    assert any(not torch.equal(masters[n], v) for n, v in read_hf_tensors(path).items())  # it trained
    x = tokens()
    ours = our_logits(hf_model_config(path), masters, x)
    assert (hf_logits(trained, x) - ours).abs().max() <= FP32_ATOL


GPT_TINY = ModelConfig("gpt-tiny", "gpt", DecoderConfig("gpt", 32, 2, 4, 4, 8, 128, 96, tied=True, positions=32,
                                                        qkv_bias=True, o_bias=True, mlp_bias=True))


@pytest.mark.parametrize("config", [get_config("tiny-gpt"), get_config("tiny-moe"), GPT_TINY],
                         ids=lambda c: c.name)
def test_catalog_models_export_with_a_generated_config(tmp_path: Path, config: ModelConfig) -> None:
    tensors = {t.name: initial_value(t.name, t.shape, seed=3) * 20 for t in model_from_config(config).tensors}
    out = str(tmp_path / "out")
    export_hf(out, tensors, config=config, dtype=torch.float32, max_file_bytes=200_000)
    assert os.path.exists(os.path.join(out, INDEX)) == (len([f for f in os.listdir(out) if "safetensors" in f]) > 1)
    back = hf_model_config(out)  # the generated config.json describes the same model
    assert [(t.name, t.shape) for t in model_from_config(back).tensors] == [
        (t.name, t.shape) for t in model_from_config(config).tensors]
    assert replace(back.llm, hidden_act="") == config.llm
    x = tokens() % config.llm.vocab
    assert (hf_logits(out, x) - our_logits(config, tensors, x)).abs().max() <= FP32_ATOL
    assert json.loads(Path(out, "config.json").read_text())["dtype"] == "float32"


def test_bf16_export_of_an_fp32_source(hf_dir, tmp_path: Path) -> None:
    """dtype=bf16: every tensor the bf16 cast of the source's, config.json's dtype says so, the
    source's file split kept; transformers' fp32 run of it is our fp32 model's on the cast weights."""
    path = hf_dir("llama")
    out = str(tmp_path / "out")
    export_hf(out, masters_of(path), source_dir=path, dtype=torch.bfloat16)
    source, exported = weights(path), weights(out)
    assert {n: f for n, (f, _) in source.items()} == {n: f for n, (f, _) in exported.items()}
    assert all(torch.equal(exported[n][1], t.bfloat16()) for n, (_, t) in source.items())
    assert json.loads(Path(out, "config.json").read_text())["dtype"] == "bfloat16"
    x = tokens()
    cast = {n: v.bfloat16().float() for n, v in masters_of(path).items()}
    assert (hf_logits(out, x) - our_logits(hf_model_config(path), cast, x)).abs().max() <= FP32_ATOL
