"""A Nemotron-style model (issue 45, item 1) read from the config.json transformers writes:
an MLP without a gate (squared ReLU), LayerNorm1P norms with biases, RoPE on half of each
head. Oracles: transformers' own NemotronForCausalLM (the same weights give the same logits,
the same tensors), a single rank (tensor parallelism's gradients), the emulator's trace."""
from __future__ import annotations

import math

import pytest
import torch

from parallelism.layout.catalog import get_config, get_model
from parallelism.training.init import init_weights
from parallelism.training.model import build_training_model
from parallelism.training.parallel import TrainConfig
from tests.support.first_step import boxes_off_the_single_rank

pytestmark = pytest.mark.timeout(300)

transformers = pytest.importorskip("transformers")

NAME = "tiny-nemotron"
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture()
def models(tmp_path, monkeypatch):
    """A models folder holding tiny-nemotron/config.json as transformers saves it (only the keys
    that differ from NemotronConfig's defaults: the reader must share its defaults)."""
    folder = tmp_path / "models"
    transformers.NemotronConfig(**SHAPE).save_pretrained(folder / NAME)
    monkeypatch.setenv("DYNAPLANE_MODELS_DIR", str(folder))
    return folder


def _hf_name(ours: str) -> str:
    """Our tensor name -> transformers' Nemotron state-dict name."""
    fixed = {"llm.embed.weight": "model.embed_tokens.weight", "llm.head.weight": "lm_head.weight",
             "llm.final_norm.weight": "model.norm.weight", "llm.final_norm.bias": "model.norm.bias"}
    if ours in fixed:
        return fixed[ours]
    _, _, i, rest = ours.split(".", 3)
    rest = (rest.replace("attn_norm.", "input_layernorm.").replace("mlp_norm.", "post_attention_layernorm.")
            .replace("attn.", "self_attn.").replace("mlp.up.", "mlp.up_proj.").replace("mlp.down.", "mlp.down_proj."))
    for proj in "qkvo":
        rest = rest.replace(f"self_attn.{proj}.", f"self_attn.{proj}_proj.")
    return f"model.layers.{i}.{rest}"


def test_the_config_reads_as_nemotron_builds_it(models) -> None:
    c = get_config(NAME).llm
    assert (c.gated_mlp, c.norm, c.hidden_act, c.rotary_dim, c.norm_eps) == (False, "layernorm", "relu2", 8, 1e-5)
    hf = transformers.NemotronForCausalLM(transformers.NemotronConfig(**SHAPE))
    theirs = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    ours = {_hf_name(t.name): tuple(t.shape) for t in get_model(NAME).tensors}
    assert ours == theirs  # every tensor, no gate, LayerNorm biases, untied head
    assert get_model(NAME).param_count == sum(p.numel() for p in hf.parameters())


def test_the_same_weights_give_transformers_logits(models) -> None:
    """fp32, random weights (norm weights and biases too); LayerNorm1P stores weight - 1."""
    torch.manual_seed(0)
    hf = transformers.NemotronForCausalLM(transformers.NemotronConfig(**SHAPE)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = build_training_model(get_config(NAME))
    init_weights(ours, seed=1)
    state = hf.state_dict()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            value = state[_hf_name(name)]
            is_norm_weight = name.endswith("norm.weight")
            p.copy_(value + 1 if is_norm_weight else value)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 24))
    expected = hf(tokens).logits
    got = ours(tokens)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    # and the partial rotary matters: rotating every dim gives other logits
    from dataclasses import replace

    full = build_training_model(replace(get_config(NAME), llm=replace(get_config(NAME).llm, rotary_dim=0)))
    full.load_state_dict(ours.state_dict())
    assert not torch.allclose(full(tokens), expected, atol=1e-3)


@pytest.mark.distributed
def test_tensor_parallel_gradients_match_a_single_rank(models) -> None:
    config = TrainConfig(model=NAME, global_batch=4, seq_len=16, micro_batches=1, lr=3e-3)
    off, checked = boxes_off_the_single_rank(config, "tp=2,pp=1,dp=1,zero=0", 2)
    assert off == []
    assert len(checked) == 2 * len(get_model(NAME).tensors)


def test_emulate_traces_it_with_and_without_fp8(models, tmp_path, monkeypatch) -> None:
    from parallelism.emulator.emulate import EmulateRequest, emulate

    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))
    runs = {p: emulate(EmulateRequest(NAME, "tp=2,pp=2,dp=1,zero=1", 4, "h100", 4, 1, 64, precision=p))
            for p in ("bf16", "fp8")}
    for result in runs.values():
        assert result["memory"]["fits"] and result["step_seconds"] > 0
    c = get_config(NAME).llm
    # FP8 weight copies: q, k, v, o, up, down of each stage's layer, split over tp=2 (no gate)
    per_layer = c.hidden * c.head_dim * (c.heads * 2 + c.kv_heads * 2) + 2 * c.hidden * c.ffn
    grew = [b["params"] - a["params"] for a, b in zip(runs["bf16"]["memory"]["per_stage"],
                                                        runs["fp8"]["memory"]["per_stage"])]
    assert grew == [2 * per_layer // 2] * 2
    assert math.isclose(sum(grew), 2 * c.layers * per_layer / 2)
