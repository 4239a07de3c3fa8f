"""A GPT-OSS-style model (issue 45, item 1) read from the config.json transformers writes:
alternating sliding-window and full attention, a sink logit per head, biased router and
experts with the clamped SwiGLU. Oracles: transformers' GptOssForCausalLM (the same weights
give the same logits), a single rank (tensor and expert parallelism's gradients)."""
from __future__ import annotations

import pytest
import torch

from parallelism.layout.catalog import get_config, get_model
from parallelism.training.model import build_training_model
from parallelism.training.parallel import TrainConfig
from tests.support.moe_routes import moe_boxes_off_the_single_rank

pytestmark = pytest.mark.timeout(300)

transformers = pytest.importorskip("transformers")

NAME = "tiny-gpt-oss"
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
             swiglu_limit=0.7, max_position_embeddings=256,
             # plain RoPE: YaRN (GPT-OSS's own) is read and recorded, not computed (the weight loader refuses it)
             rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


@pytest.fixture()
def models(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    transformers.GptOssConfig(**SHAPE).save_pretrained(folder / NAME)
    monkeypatch.setenv("DYNAPLANE_MODELS_DIR", str(folder))
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))
    return folder


def _ours_from(hf) -> dict[str, torch.Tensor]:
    """transformers' GPT-OSS state dict in our names (gate and up interleaved in gate_up_proj,
    experts stored input-major there)."""
    state, out = hf.state_dict(), {}
    out["llm.embed.weight"], out["llm.head.weight"] = state["model.embed_tokens.weight"], state["lm_head.weight"]
    out["llm.final_norm.weight"] = state["model.norm.weight"]
    for i in range(SHAPE["num_hidden_layers"]):
        p, q = f"llm.layers.{i}.", f"model.layers.{i}."
        out[p + "attn_norm.weight"] = state[q + "input_layernorm.weight"]
        out[p + "mlp_norm.weight"] = state[q + "post_attention_layernorm.weight"]
        for proj in "qkvo":
            for kind in ("weight", "bias"):
                out[f"{p}attn.{proj}.{kind}"] = state[f"{q}self_attn.{proj}_proj.{kind}"]
        out[p + "attn.sinks"] = state[q + "self_attn.sinks"]
        out[p + "moe.router.weight"], out[p + "moe.router.bias"] = state[q + "mlp.router.weight"], state[q + "mlp.router.bias"]
        gate_up, bias = state[q + "mlp.experts.gate_up_proj"], state[q + "mlp.experts.gate_up_proj_bias"]
        out[p + "moe.experts.gate.weight"] = gate_up[..., ::2].transpose(1, 2)
        out[p + "moe.experts.up.weight"] = gate_up[..., 1::2].transpose(1, 2)
        out[p + "moe.experts.gate.bias"], out[p + "moe.experts.up.bias"] = bias[:, ::2], bias[:, 1::2]
        out[p + "moe.experts.down.weight"] = state[q + "mlp.experts.down_proj"].transpose(1, 2)
        out[p + "moe.experts.down.bias"] = state[q + "mlp.experts.down_proj_bias"]
    return out


def test_the_config_reads_as_gpt_oss_builds_it(models) -> None:
    c = get_config(NAME).llm
    assert (c.experts, c.top_k, c.moe_ffn, c.attention_sinks, c.moe_bias, c.swiglu_limit) == (4, 2, 16, True, True, 0.7)
    assert (c.sliding_window, c.window_layers) == (4, frozenset({0}))  # layer_types: sliding, full
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SHAPE))
    ours = {t.name: tuple(t.shape) for t in get_model(NAME).tensors}
    assert {name: tuple(t.shape) for name, t in _ours_from(hf).items()} == ours
    assert get_model(NAME).param_count == sum(p.numel() for p in hf.parameters())


def test_the_same_weights_give_transformers_logits(models) -> None:
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SHAPE)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = build_training_model(get_config(NAME))
    ours.load_state_dict(_ours_from(hf))
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 12))
    expected = hf(tokens).logits
    assert torch.allclose(ours(tokens), expected, atol=1e-4), (ours(tokens) - expected).abs().max()
    # the sinks and the clamp matter
    with torch.no_grad():
        for layer in ours.llm.layers:
            layer.attn.sinks.fill_(-30.0)
    assert not torch.allclose(ours(tokens), expected, atol=1e-3)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp=2,pp=1,dp=1,zero=0", "tp=1,pp=1,dp=2,ep=2,zero=0"])
def test_parallel_gradients_match_a_single_rank(models, layout: str) -> None:
    """Routed alike (tests/support/moe_routes.py: top-k flips of near-tied tokens under the
    layout's bf16 rounding are routing, not gradients)."""
    config = TrainConfig(model=NAME, global_batch=4, seq_len=8, micro_batches=1, lr=3e-3)
    off, checked, _ = moe_boxes_off_the_single_rank(config, layout, 2)
    assert off == []
    assert len(set(checked)) == len(get_model(NAME).tensors)


def test_emulate_traces_it(models) -> None:
    from parallelism.emulator.emulate import EmulateRequest, emulate

    result = emulate(EmulateRequest(NAME, "tp=2,pp=1,dp=2,ep=2,zero=1", 4, "h100", 8, 1, 16))
    assert result["step_seconds"] > 0 and result["memory"]["fits"]
