"""Model catalog: published sizes, exact names/shapes/splits, global order, Hugging Face config.json loading."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from parallelism.layout.catalog import (
    PUBLISHED_ENCODER_PARAMS,
    PUBLISHED_PARAMS,
    build_model,
    catalog_names,
    get_config,
    get_model,
    model_summary,
)
from parallelism.layout.errors import LayoutError
from parallelism.layout.tensors import Model, TensorSpec, TensorSplit

LLAMA3_8B_HF: dict[str, Any] = {  # meta-llama/Meta-Llama-3-8B, verbatim keys
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
QWEN3_235B_HF: dict[str, Any] = {  # Qwen/Qwen3-235B-A22B
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 94, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 94, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}
GPT2_HF: dict[str, Any] = {  # openai-community/gpt2
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
    "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
}
MIXTRAL_HF: dict[str, Any] = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "rope_theta": 1e6, "tie_word_embeddings": False, "vocab_size": 32000,
}
QWEN2_7B_HF: dict[str, Any] = {  # Qwen/Qwen2-7B
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": 152064,
}


def write_config(tmp_path: Path, raw: dict[str, Any], directory: str = "model") -> str:
    path = tmp_path / directory / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(raw))
    return str(path)


def by_name(model: Model) -> dict[str, TensorSpec]:
    return {t.name: t for t in model.tensors}


def split(module: str = "llm", layer: int | None = None, place: str | None = None, tp_dim: int | None = None,
          tp_units: int | None = None, ep_dim: int | None = None) -> TensorSplit:
    return TensorSplit(module, layer, place, tp_dim, tp_units, ep_dim)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_counts_match_published_within_half_a_percent(name: str) -> None:
    count, published = get_model(name).param_count, PUBLISHED_PARAMS[name]
    assert abs(count - published) / published < 0.005, (name, count, published)


@pytest.mark.parametrize("name", sorted(PUBLISHED_ENCODER_PARAMS))
def test_vision_towers_match_published_within_half_a_percent(name: str) -> None:
    model = get_model(name)
    tower = sum(t.numel for t in model.tensors if t.split.module == "encoder" and ".projector." not in t.name)
    published = PUBLISHED_ENCODER_PARAMS[name]
    assert abs(tower - published) / published < 0.005, (name, tower, published)
    llm = sum(t.numel for t in model.tensors if t.split.module == "llm")
    assert llm == get_model(name.split("-", 1)[1]).param_count  # the catalog's LLM, unchanged


def test_catalog_has_the_contract_models() -> None:
    names = catalog_names()
    assert {"tiny-gpt", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "qwen3-235b-a22b",
            "llava-vitl-llama3-8b", "tiny-vlm"} <= set(names)
    assert set(PUBLISHED_PARAMS) <= set(names)
    assert any(len(get_model(n).modules) == 2 for n in PUBLISHED_PARAMS)  # a real encoder+LLM model


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("tiny-gpt", 4 * 9 + 3),
        ("llama3-8b", 32 * 9 + 3),
        ("llama3-70b", 80 * 9 + 3),
        ("llama3-405b", 126 * 9 + 3),
        ("gpt3-175b", 2 + 96 * 16 + 2),  # embed + pos_embed, 16 per layer, final norm weight+bias, no head
        ("qwen3-235b-a22b", 94 * 12 + 3),
        ("llava-vitl-llama3-8b", 5 + 24 * 16 + 6 + 32 * 9 + 3),
        ("tiny-vlm", 5 + 2 * 16 + 6 + 4 * 9 + 3),
    ],
)
def test_exact_tensor_counts(name: str, count: int) -> None:
    assert len(get_model(name).tensors) == count


def test_llama3_8b_shapes_and_splits() -> None:
    t = by_name(get_model("llama3-8b"))
    assert t["llm.embed.weight"].shape == (128256, 4096)
    assert t["llm.embed.weight"].split == split(place="first", tp_dim=0)
    assert t["llm.layers.3.attn.k.weight"].shape == (1024, 4096)
    assert t["llm.layers.3.attn.k.weight"].split == split(layer=3, tp_dim=0, tp_units=8)
    assert t["llm.layers.0.attn.q.weight"].split == split(layer=0, tp_dim=0, tp_units=32)
    assert t["llm.layers.31.attn.o.weight"].split == split(layer=31, tp_dim=1, tp_units=32)
    assert t["llm.layers.0.attn_norm.weight"].split == split(layer=0)
    assert t["llm.layers.0.mlp.gate.weight"].shape == (14336, 4096)
    assert t["llm.layers.0.mlp.down.weight"].shape == (4096, 14336)
    assert t["llm.layers.0.mlp.down.weight"].split == split(layer=0, tp_dim=1)
    assert t["llm.final_norm.weight"].split == split(place="last")
    assert t["llm.head.weight"].split == split(place="last", tp_dim=0)
    layer0 = [n.removeprefix("llm.layers.0.") for n in t if n.startswith("llm.layers.0.")]
    assert layer0 == ["attn_norm.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
                      "mlp_norm.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"]


def test_tiny_gpt_shapes() -> None:
    model = get_model("tiny-gpt")
    t = by_name(model)
    assert t["llm.layers.0.attn.q.weight"].shape == (64, 64)
    assert t["llm.layers.0.attn.k.weight"].shape == (32, 64)  # 2 kv heads of 16
    assert t["llm.layers.0.mlp.up.weight"].shape == (176, 64)
    assert t["llm.head.weight"].shape == (512, 64)
    assert (model.module("llm").num_heads, model.module("llm").num_kv_heads) == (4, 2)


def test_gpt3_is_tied_with_biases_and_learned_positions() -> None:
    t = by_name(get_model("gpt3-175b"))
    assert "llm.head.weight" not in t
    assert t["llm.embed.weight"].split == split(place="first+last", tp_dim=0)
    assert t["llm.pos_embed.weight"].shape == (2048, 12288)
    assert t["llm.pos_embed.weight"].split == split(place="first")
    assert t["llm.layers.5.attn.q.bias"].split == split(layer=5, tp_dim=0, tp_units=96)
    assert t["llm.layers.5.attn.o.bias"].split == split(layer=5)
    assert t["llm.layers.5.mlp.fc1.weight"].shape == (49152, 12288)
    assert t["llm.layers.5.mlp.fc1.bias"].split == split(layer=5, tp_dim=0)
    assert t["llm.layers.5.mlp.fc2.weight"].split == split(layer=5, tp_dim=1)
    assert t["llm.layers.5.mlp.fc2.bias"].split == split(layer=5)
    assert t["llm.final_norm.bias"].split == split(place="last")


def test_qwen3_moe_shapes() -> None:
    model = get_model("qwen3-235b-a22b")
    t = by_name(model)
    p = "llm.layers.7."
    assert t[p + "attn.q.weight"].shape == (8192, 4096)
    assert t[p + "attn.q.weight"].split.tp_units == 64
    assert t[p + "attn.k.weight"].shape == (512, 4096)
    assert t[p + "attn.k.weight"].split.tp_units == 4
    assert t[p + "attn.o.weight"].shape == (4096, 8192)
    assert t[p + "attn.q_norm.weight"].shape == t[p + "attn.k_norm.weight"].shape == (128,)
    assert t[p + "attn.q_norm.weight"].split == split(layer=7)
    assert t[p + "moe.router.weight"].shape == (128, 4096)
    assert t[p + "moe.router.weight"].split == split(layer=7)
    assert t[p + "moe.experts.gate.weight"].shape == t[p + "moe.experts.up.weight"].shape == (128, 1536, 4096)
    assert t[p + "moe.experts.gate.weight"].split == split(layer=7, tp_dim=1, ep_dim=0)
    assert t[p + "moe.experts.down.weight"].shape == (128, 4096, 1536)
    assert t[p + "moe.experts.down.weight"].split == split(layer=7, tp_dim=2, ep_dim=0)
    assert not any(".mlp." in n for n in t)  # every layer is MoE
    assert model.module("llm").num_experts == 128
    assert get_config("qwen3-235b-a22b").llm.top_k == 8


def test_llava_encoder_projector_and_llm() -> None:
    model = get_model("llava-vitl-llama3-8b")
    t = by_name(model)
    assert [m.name for m in model.modules] == ["encoder", "llm"]
    assert (model.module("encoder").num_layers, model.module("encoder").num_heads) == (24, 16)
    assert t["encoder.patch_embed.weight"].shape == (1024, 3 * 14 * 14)
    assert t["encoder.patch_embed.weight"].split == split("encoder", place="first")
    assert t["encoder.cls_token"].shape == (1, 1024)
    assert t["encoder.pos_embed.weight"].shape == (577, 1024)
    assert t["encoder.layers.23.attn.v.weight"].split == split("encoder", layer=23, tp_dim=0, tp_units=16)
    assert t["encoder.layers.0.mlp.fc1.weight"].shape == (4096, 1024)
    assert t["encoder.projector.fc1.weight"].shape == (4096, 1024)
    assert t["encoder.projector.fc1.weight"].split == split("encoder", place="last", tp_dim=0)
    assert t["encoder.projector.fc2.weight"].split == split("encoder", place="last", tp_dim=1)
    assert t["encoder.projector.fc2.bias"].split == split("encoder", place="last")
    llm = [x for x in model.tensors if x.split.module == "llm"]
    assert tuple(llm) == get_model("llama3-8b").tensors


def test_tiny_vlm_shapes() -> None:
    model = get_model("tiny-vlm")
    t = by_name(model)
    assert t["encoder.patch_embed.weight"].shape == (32, 48)
    assert t["encoder.pos_embed.weight"].shape == (17, 32)
    assert t["encoder.layers.1.attn.q.weight"].split.tp_units == 2
    assert t["encoder.projector.fc1.weight"].shape == (64, 32)
    assert t["encoder.projector.fc2.weight"].shape == (64, 64)
    assert tuple(x for x in model.tensors if x.split.module == "llm") == get_model("tiny-gpt").tensors


@pytest.mark.parametrize("name", catalog_names())
def test_names_unique_and_order_is_first_layers_last_per_module(name: str) -> None:
    model = get_model(name)
    names = [t.name for t in model.tensors]
    assert len(set(names)) == len(names)
    modules = [t.split.module for t in model.tensors]
    assert sorted(set(modules), key=modules.index) == [m.name for m in model.modules]
    assert modules == sorted(modules, key=[m.name for m in model.modules].index)  # each module contiguous
    for m in model.modules:
        # rank: 0 first-place, 1 + layer, then last-place; must never decrease.
        keys = [-1 if t.split.place in ("first", "first+last") else
                (t.split.layer if t.split.layer is not None else 10**9)
                for t in model.tensors if t.split.module == m.name]
        assert keys == sorted(keys)
        assert sorted({t.split.layer for t in model.tensors if t.split.module == m.name} - {None}) == list(
            range(m.num_layers))
        assert all(n.startswith(m.name + ".") for n, mod in zip(names, modules) if mod == m.name)


def test_deterministic_and_cached() -> None:
    assert get_model("llama3-8b") is get_model("llama3-8b")
    assert build_model(get_config("qwen3-235b-a22b")).tensors == get_model("qwen3-235b-a22b").tensors


def test_summary() -> None:
    s = model_summary(get_model("llava-vitl-llama3-8b"))
    assert s["layers"] == {"encoder": 24, "llm": 32}
    assert (s["hidden"], s["heads"], s["kv_heads"], s["experts"], s["vocab"]) == (4096, 32, 8, 0, 128256)
    assert s["params"] == get_model("llava-vitl-llama3-8b").param_count
    s = model_summary(get_model("qwen3-235b-a22b"))
    assert (s["name"], s["family"], s["experts"], s["kv_heads"]) == ("qwen3-235b-a22b", "qwen3_moe", 128, 4)
    json.dumps(s)


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(LayoutError, match="unknown model 'llama9'") as info:
        get_model("llama9")
    assert all(n in str(info.value) for n in catalog_names())


# ---- Hugging Face config.json ----

@pytest.mark.parametrize(
    ("raw", "equivalent"),
    [
        (LLAMA3_8B_HF, "llama3-8b"),
        (QWEN3_235B_HF, "qwen3-235b-a22b"),
        ({**GPT2_HF, "n_embd": 12288, "n_head": 96, "n_layer": 96, "n_positions": 2048}, "gpt3-175b"),
        ({k: v for k, v in LLAMA3_8B_HF.items() if k not in ("num_key_value_heads",)} | {
            "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 176, "vocab_size": 512}, "tiny-gpt"),
    ],
)
def test_hf_config_reproduces_catalog_model(tmp_path: Path, raw: dict[str, Any], equivalent: str) -> None:
    model = get_model(write_config(tmp_path, raw))
    assert model.tensors == get_model(equivalent).tensors
    assert model.modules == get_model(equivalent).modules


def test_hf_name_from_directory_or_name_or_path(tmp_path: Path) -> None:
    path = write_config(tmp_path, LLAMA3_8B_HF, "Meta-Llama-3-8B")
    assert get_model(path).name == "Meta-Llama-3-8B"
    assert get_model(str(Path(path).parent)).name == "Meta-Llama-3-8B"  # the directory works too
    named = write_config(tmp_path, {**LLAMA3_8B_HF, "_name_or_path": "meta-llama/Meta-Llama-3-8B"}, "other")
    assert get_model(named).name == "meta-llama/Meta-Llama-3-8B"


def test_hf_edited_config_is_reread(tmp_path: Path) -> None:
    path = write_config(tmp_path, LLAMA3_8B_HF)
    assert get_model(path).module("llm").num_layers == 32
    Path(path).write_text(json.dumps({**LLAMA3_8B_HF, "num_hidden_layers": 2, "vocab_size": 1000}))
    assert get_model(path).module("llm").num_layers == 2


def test_hf_gpt2_small(tmp_path: Path) -> None:
    model = get_model(write_config(tmp_path, GPT2_HF))
    assert model.param_count == 124_439_808  # transformers' GPT2LMHeadModel, tied head not counted twice
    t = by_name(model)
    assert "llm.head.weight" not in t and t["llm.embed.weight"].split.place == "first+last"
    assert t["llm.pos_embed.weight"].shape == (1024, 768)
    assert model.family == "gpt"


def test_hf_mixtral(tmp_path: Path) -> None:
    model = get_model(write_config(tmp_path, MIXTRAL_HF))
    assert model.param_count == 46_702_792_704  # Mixtral-8x7B's safetensors total
    t = by_name(model)
    assert t["llm.layers.0.moe.router.weight"].shape == (8, 4096)
    assert t["llm.layers.0.moe.experts.gate.weight"].shape == (8, 14336, 4096)
    assert t["llm.layers.0.moe.experts.down.weight"].shape == (8, 4096, 14336)
    assert model.module("llm").num_experts == 8
    assert get_config(str(tmp_path / "model" / "config.json")).llm.top_k == 2


def test_hf_qwen2_has_qkv_biases(tmp_path: Path) -> None:
    model = get_model(write_config(tmp_path, QWEN2_7B_HF))
    assert model.param_count == 7_615_616_512  # Qwen2-7B's safetensors total
    t = by_name(model)
    assert t["llm.layers.0.attn.q.bias"].shape == (3584,)
    assert t["llm.layers.0.attn.q.bias"].split == split(layer=0, tp_dim=0, tp_units=28)
    assert t["llm.layers.0.attn.k.bias"].shape == (512,)
    assert t["llm.layers.0.attn.k.bias"].split.tp_units == 4
    assert "llm.layers.0.attn.o.bias" not in t and "llm.layers.0.attn.q_norm.weight" not in t


def test_hf_qwen3_moe_dense_layers(tmp_path: Path) -> None:
    raw = {**QWEN3_235B_HF, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    t = by_name(get_model(write_config(tmp_path, raw)))
    sparse = [i for i in range(6) if f"llm.layers.{i}.moe.router.weight" in t]
    assert sparse == [1, 5]  # (i + 1) % 2 == 0, minus mlp_only layer 3
    assert t["llm.layers.0.mlp.gate.weight"].shape == (12288, 4096)
    assert "llm.layers.0.moe.experts.up.weight" not in t


def test_hf_tied_llama(tmp_path: Path) -> None:
    t = by_name(get_model(write_config(tmp_path, {**LLAMA3_8B_HF, "tie_word_embeddings": True})))
    assert "llm.head.weight" not in t and t["llm.embed.weight"].split.place == "first+last"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({k: v for k, v in LLAMA3_8B_HF.items() if k != "hidden_size"}, "missing key 'hidden_size'"),
        ({k: v for k, v in GPT2_HF.items() if k != "n_layer"}, "missing key 'n_layer' or 'num_hidden_layers'"),
        ({k: v for k, v in QWEN3_235B_HF.items() if k != "moe_intermediate_size"}, "'moe_intermediate_size'"),
        ({**LLAMA3_8B_HF, "model_type": "bert"}, "unsupported model_type 'bert'"),
        ({k: v for k, v in LLAMA3_8B_HF.items() if k != "model_type"}, "unsupported model_type None"),
        ({**LLAMA3_8B_HF, "num_key_value_heads": 5}, "not a multiple of num_key_value_heads 5"),
        ({**LLAMA3_8B_HF, "vocab_size": "big"}, "vocab_size='big' must be an integer"),
        ({**LLAMA3_8B_HF, "tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' must be true or false"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_hf_bad_config_names_key_and_file(tmp_path: Path, raw: Any, message: str) -> None:
    path = write_config(tmp_path, raw)
    with pytest.raises(LayoutError, match=message) as info:
        get_model(path)
    assert path in str(info.value)


def test_hf_unreadable_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(LayoutError, match="cannot read"):
        get_model(str(path))


def test_pure_core_imports_no_torch_or_django() -> None:
    code = "import sys, parallelism.layout.catalog, parallelism.layout.hf_config; " \
           "assert 'torch' not in sys.modules and 'django' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3])
