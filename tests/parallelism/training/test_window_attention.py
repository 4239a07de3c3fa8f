"""Sliding-window attention and attention sinks (parallelism/training/window_attention.py),
against torch's own attention with an explicit mask (the window) and the softmax written out
with a sink column (the sinks); a Mistral-style config.json read and trained, against
transformers' MistralForCausalLM; and the emulator pricing a windowed layer by its window."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallelism.emulator.recorder import causal_fraction, window_fraction
from parallelism.layout.catalog import get_config, get_model
from parallelism.training.model import build_training_model
from parallelism.training.window_attention import window_attention

pytestmark = pytest.mark.timeout(300)


def _qkv(heads: int = 4, kv_heads: int = 2, seq: int = 12, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, dim, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, dim, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, dim, generator=g, requires_grad=True)
    return q, k, v


def _reference(q, k, v, window: int, sinks=None):
    """Written out: scores, the window's mask, a sink column in the softmax (then dropped)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    scores = scores.masked_fill(~((j <= i) & (i - j < window if window else True)), float("-inf"))
    if sinks is not None:
        column = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat((scores, column), -1), -1)[..., :-1] @ v
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("window", [0, 1, 3, 12, 40])
def test_the_window_matches_torch_attention_with_the_same_mask(window: int) -> None:
    q, k, v = _qkv()
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    mask = (j <= i) & ((i - j < window) if window else True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = window_attention(q, k, v, window)
    assert torch.allclose(got, expected, atol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    wanted = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for a, b in zip(grads, wanted):
        assert torch.allclose(a, b, atol=1e-5)


def test_sinks_take_weight_from_every_key_and_learn() -> None:
    q, k, v = _qkv(seed=1)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 8.0], requires_grad=True)
    got = window_attention(q, k, v, 5, sinks)
    expected = _reference(q, k, v, 5, sinks)
    assert torch.allclose(got, expected, atol=1e-5)
    assert got[:, 3].abs().max() < 0.1 * got[:, 0].abs().max()  # a large sink: that head attends nearly nowhere
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, sinks))
    wanted = torch.autograd.grad(expected.square().sum(), (q, k, v, sinks))
    for a, b in zip(grads, wanted):
        assert torch.allclose(a, b, atol=1e-5)


def test_bf16_inputs_give_bf16_outputs_near_the_fp32_result() -> None:
    q, k, v = (t.detach() for t in _qkv(seed=2))
    got = window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 4)
    assert got.dtype == torch.bfloat16
    assert (got.float() - window_attention(q, k, v, 4)).abs().max() < 0.05
    with pytest.raises(ValueError, match="window=-1 must be >= 0"):
        window_attention(q, k, v, -1)


def test_window_fraction_counts_the_scores_inside_the_window() -> None:
    for s, w in [(1, 1), (7, 3), (64, 16), (100, 1000), (33, 1)]:
        brute = sum(min(i + 1, w) for i in range(s)) / (s * s)
        assert window_fraction(s, s, w) == pytest.approx(brute)
    assert window_fraction(64, 64, 0) == causal_fraction(64, 64)


MISTRAL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, sliding_window=4, max_position_embeddings=256)


@pytest.fixture()
def mistral(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "models"
    transformers.MistralConfig(**MISTRAL).save_pretrained(folder / "tiny-mistral")
    monkeypatch.setenv("DYNAPLANE_MODELS_DIR", str(folder))
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))
    return transformers


def test_a_mistral_config_windows_every_layer_and_computes_transformers_logits(mistral) -> None:
    c = get_config("tiny-mistral").llm
    assert (c.sliding_window, c.window_layers) == (4, frozenset({0, 1}))
    torch.manual_seed(0)
    hf = mistral.MistralForCausalLM(mistral.MistralConfig(**MISTRAL)).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = build_training_model(get_config("tiny-mistral"))
    state = hf.state_dict()

    def theirs(name: str) -> str:
        fixed = {"llm.embed.weight": "model.embed_tokens.weight", "llm.head.weight": "lm_head.weight",
                 "llm.final_norm.weight": "model.norm.weight"}
        if name in fixed:
            return fixed[name]
        _, _, i, rest = name.split(".", 3)
        rest = rest.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")
        for proj in "qkvo":
            rest = rest.replace(f"attn.{proj}.", f"self_attn.{proj}_proj.")
        for proj in ("gate", "up", "down"):
            rest = rest.replace(f"mlp.{proj}.", f"mlp.{proj}_proj.")
        return f"model.layers.{i}.{rest}"

    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(state[theirs(name)])
    tokens = torch.randint(0, MISTRAL["vocab_size"], (2, 20))
    expected = hf(tokens).logits
    assert torch.allclose(ours(tokens), expected, atol=1e-4)
    # and the window matters: the same weights without it give other logits
    full = mistral.MistralForCausalLM(mistral.MistralConfig(**{**MISTRAL, "sliding_window": None})).float().eval()
    full.load_state_dict(state)
    assert not torch.allclose(full(tokens).logits, expected, atol=1e-3)


def test_the_emulator_prices_a_windowed_layer_by_its_window(mistral) -> None:
    from parallelism.emulator.trace_build import TraceRequest
    from parallelism.emulator.tracer import trace

    seq = 64
    traced, _ = trace(TraceRequest("tiny-mistral", "tp=2", 1, seq, 1, 8, False))
    ops = [op for op in traced.stages[0].forward if getattr(op, "kind", "") == "attention"]
    assert [op.name for op in ops] == ["window_attention"] * 2
    b, h, d = 1, 2, 8
    assert all(op.shape == (b, h, seq, 4, d) for op in ops)  # the kernel's inner loop: the window's 4 keys
    assert ops[0].flops == pytest.approx(4 * b * h * seq * seq * d * window_fraction(seq, seq, 4))
    back = [op for op in traced.stages[0].backward if getattr(op, "kind", "") == "attention"]
    assert [op.name for op in back] == ["window_attention_backward"] * 2
    assert back[0].flops == pytest.approx(2.5 * ops[0].flops)


@pytest.mark.distributed
def test_tensor_parallel_gradients_of_a_windowed_model_match_a_single_rank(mistral) -> None:
    from parallelism.training.parallel import TrainConfig
    from tests.support.first_step import boxes_off_the_single_rank

    config = TrainConfig(model="tiny-mistral", global_batch=4, seq_len=16, micro_batches=1, lr=3e-3)
    off, checked = boxes_off_the_single_rank(config, "tp=2,pp=1,dp=1,zero=0", 2)
    assert off == []
    assert len(checked) == 2 * len(get_model("tiny-mistral").tensors)


def test_a_window_with_context_parallelism_is_refused_by_name(mistral) -> None:
    from parallelism.layout.placement import place
    from parallelism.training.parallel import TrainConfig, TrainingError, check_trainable

    config = TrainConfig(model="tiny-mistral", global_batch=4, seq_len=16, micro_batches=1)
    with pytest.raises(TrainingError, match=r"sliding-window attention \(4 keys\) with context parallelism \(cp=2\)"):
        check_trainable(config, place(get_model("tiny-mistral"), "cp=2"))
