"""Our model holding a Hugging Face checkpoint's weights computes transformers' logits, for every
family (and a sharded save, a bf16 save, Llama 3.1's RoPE, fused Mixtral experts).

Tolerances. fp32: 1e-4 absolute on logits of magnitude ~6 (both run the same formulas in
fp32; the llama family matches bit for bit, GPT-2 to ~2e-6 because transformers' gelu_new and
torch's tanh GELU round differently). bf16 (params are the bf16 cast of the fp32 masters, as
the trainer holds them): bf16 keeps 8 significant bits (unit roundoff 2^-8 = 0.4%), and on
these 2-3 layer models transformers' own bf16 run is up to 3% of the logit range away from
its fp32 run; ours may be 6% (twice that). MoE in bf16: a token whose router scores for its
k-th and (k+1)-th experts are nearly tied may switch experts under rounding (transformers'
bf16 run does too, on other tokens), which moves its logits, and those of every later token
attending to it, far; so the tolerance holds on the positions routed as in fp32 (every
position of the dense models; over half of them must be so). Every tensor matters to the fp32 comparison: each one
permuted moves the logits by far more than its tolerance (test_each_tensor_matters), bar
GPT-2's key bias, which softmax cannot see (a constant added to every score of a query).
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from parallelism.engine.shards import rank_boxes
from parallelism.hf_weights import (HFMap, assemble, hf_initial_shards, hf_model_config, open_hf_source,
                                    read_hf_tensors)
from parallelism.hf_weights.convert import from_hf
from parallelism.layout.catalog import model_from_config
from parallelism.layout.placement import place
from tests.parallelism.hf_weights.conftest import CASES
from tests.parallelism.hf_weights.tiny_hf import hf_logits, our_logits, our_routes, tokens

FP32_ATOL = 1e-4
BF16_REL = 0.06


def check_bf16(config, tensors: dict[str, torch.Tensor], ours: torch.Tensor, ref: torch.Tensor,
               x: torch.Tensor) -> None:
    """Every position routed as in fp32 (all of a dense model's) within BF16_REL of the logit range."""
    routed = our_routes(config, tensors, x, torch.bfloat16)
    assert routed.float().mean() > 0.5, routed
    error = (ours - ref).abs().amax(-1)
    assert (error[routed] <= BF16_REL * ref.abs().max()).all(), (error, routed)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_logits_equal_transformers(hf_dir, case: str) -> None:
    path = hf_dir(case)
    x = tokens()
    ours = our_logits(hf_model_config(path), read_hf_tensors(path), x)
    assert (ours - hf_logits(path, x)).abs().max() <= FP32_ATOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_params_from_the_loader(hf_dir, case: str) -> None:
    """hf_initial_shards on one rank: masters are the stored values in fp32, params their bf16
    cast, moments zero; the bf16 model on those params is within the bf16 tolerance."""
    path = hf_dir(case)
    config = hf_model_config(path)
    placement = place(model_from_config(config), "tp=1,pp=1,dp=1,zero=1")
    shards = hf_initial_shards(placement, 0, path)
    assert set(shards) == set(rank_boxes(placement, 0))
    masters = assemble(placement.model, shards.values(), "master")
    params = assemble(placement.model, shards.values(), "param")
    stored = read_hf_tensors(path, dtype=None)
    for name, value in stored.items():
        assert masters[name].dtype == torch.float32 and torch.equal(masters[name], value.float()), name
        assert params[name].dtype == torch.bfloat16 and torch.equal(params[name], value.float().bfloat16()), name
    assert all(not s.data.any() for (_, state), s in shards.items() if state.startswith("exp_avg"))
    x = tokens()
    check_bf16(config, masters, our_logits(config, params, x, torch.bfloat16), hf_logits(path, x), x)


@pytest.mark.parametrize("case", ["llama", "qwen3", "mixtral", "qwen3_moe", "gpt2"])
def test_each_tensor_matters(hf_dir, case: str) -> None:
    """Any one tensor misplaced (its rows rolled by one: a permutation; a 1-row or 1-D tensor
    scaled instead) moves the fp32 logits by over 100x the tolerance: the equality above would
    catch a wrong mapping of any tensor."""
    path = hf_dir(case)
    config, tensors, x = hf_model_config(path), read_hf_tensors(path), tokens()
    ref = hf_logits(path, x)
    for name, value in tensors.items():
        if case == "gpt2" and name.endswith("attn.k.bias"):
            continue  # softmax(q.(k + b)) == softmax(q.k): the key bias never reaches the logits
        wrong = value.roll(1, 0) if value.shape[0] > 1 else value * 1.5 + 0.1
        moved = (our_logits(config, {**tensors, name: wrong}, x) - ref).abs().max()
        assert moved > 100 * FP32_ATOL, (name, float(moved))


def test_swapped_experts_and_fused_halves_are_caught(hf_dir) -> None:
    """The MoE-specific mistakes: two experts exchanged, or gate and up read from the wrong half
    of a fused gate_up_proj."""
    path = hf_dir("mixtral-fused")
    config, tensors, x = hf_model_config(path), read_hf_tensors(path), tokens()
    ref = hf_logits(path, x)
    gate = "llm.layers.1.moe.experts.gate.weight"
    up = "llm.layers.1.moe.experts.up.weight"
    swapped = tensors[gate][[1, 0, 2, 3]]
    for wrong in ({gate: swapped}, {gate: tensors[up], up: tensors[gate]}):
        assert (our_logits(config, {**tensors, **wrong}, x) - ref).abs().max() > 100 * FP32_ATOL


@pytest.mark.parametrize(("case", "first", "second"), [
    ("gpt2", "llm.layers.0.attn.q.weight", "llm.layers.0.attn.k.weight"),  # c_attn's column ranges exchanged
    ("mixtral", "llm.layers.0.moe.experts.gate.weight", "llm.layers.0.moe.experts.up.weight"),  # w1 <-> w3
])
def test_a_wrong_map_is_caught(hf_dir, case: str, first: str, second: str) -> None:
    """An adapter with two same-shaped tensors' pieces exchanged loads tensors whose logits are far
    from transformers': the fp32 equality checks the adapter itself."""
    path = hf_dir(case)
    source = open_hf_source(path)
    pieces = dict(source.hfmap.pieces)
    pieces[first], pieces[second] = pieces[second], pieces[first]
    wrong = HFMap(source.hfmap.model_type, source.hfmap.variant, pieces, source.hfmap.ignored)
    stored = load_file(os.path.join(path, "model.safetensors"))
    x = tokens()
    moved = (our_logits(source.config, from_hf(wrong, stored), x) - hf_logits(path, x)).abs().max()
    assert moved > 100 * FP32_ATOL
    assert (our_logits(source.config, from_hf(source.hfmap, stored), x) - hf_logits(path, x)).abs().max() <= FP32_ATOL
