"""hf_config reads the numerics a checkpoint fixes (RoPE base and scaling, norm epsilon, MoE gate
normalization, activation) in transformers 5's spelling (rope_parameters, num_local_experts) and
the older one (top-level rope_theta, rope_scaling, num_experts); the catalog keeps its defaults."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from parallelism.layout.catalog import get_config
from parallelism.layout.errors import LayoutError
from parallelism.layout.model_config import ROPE_THETA, RopeScaling
from tests.parallelism.layout.test_catalog import GPT2_HF, LLAMA3_8B_HF, MIXTRAL_HF, QWEN3_235B_HF


def read(tmp_path: Path, raw: dict[str, Any]):
    folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"  # a fresh file each time: get_config caches by path
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(raw))
    return get_config(str(path)).llm


def test_catalog_models_keep_their_numerics() -> None:
    for name in ("tiny-gpt", "tiny-moe", "llama3-8b", "gpt3-175b"):
        c = get_config(name).llm
        assert (c.rope_theta, c.rope_scaling, c.norm_eps, c.norm_topk_prob, c.hidden_act) == (
            ROPE_THETA, None, 1e-5, True, "")


def test_older_spelling(tmp_path: Path) -> None:
    c = read(tmp_path, LLAMA3_8B_HF)
    assert (c.rope_theta, c.rope_scaling, c.norm_eps, c.hidden_act) == (500000.0, None, 1e-5, "silu")
    q = read(tmp_path, QWEN3_235B_HF)
    assert (q.rope_theta, q.norm_eps, q.norm_topk_prob) == (1e6, 1e-6, True)


def test_transformers_5_spelling(tmp_path: Path) -> None:
    raw = {**QWEN3_235B_HF, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6}, "norm_topk_prob": False}
    del raw["rope_theta"]
    raw["num_local_experts"] = raw.pop("num_experts")  # transformers 5 saves it under its attribute_map name
    c = read(tmp_path, raw)
    assert (c.rope_theta, c.norm_topk_prob, c.experts) == (5e6, False, 128)


def test_defaults_per_model_type(tmp_path: Path) -> None:
    mixtral = read(tmp_path, {k: v for k, v in MIXTRAL_HF.items() if k != "rope_theta"})
    assert (mixtral.rope_theta, mixtral.norm_eps, mixtral.norm_topk_prob) == (1e6, 1e-5, True)
    llama = read(tmp_path, {k: v for k, v in LLAMA3_8B_HF.items() if k not in ("rope_theta", "rms_norm_eps")})
    assert (llama.rope_theta, llama.norm_eps) == (1e4, 1e-6)  # LlamaConfig's defaults
    qwen_moe = read(tmp_path, {k: v for k, v in QWEN3_235B_HF.items() if k != "norm_topk_prob"})
    assert qwen_moe.norm_topk_prob is False  # Qwen3MoeConfig's default
    gpt2 = read(tmp_path, {**GPT2_HF, "layer_norm_epsilon": 1e-6, "activation_function": "gelu"})
    assert (gpt2.norm_eps, gpt2.hidden_act) == (1e-6, "gelu")


def test_llama3_rope_scaling(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    c = read(tmp_path, {**LLAMA3_8B_HF, "rope_scaling": scaling})
    assert c.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    yarn = read(tmp_path, {**LLAMA3_8B_HF, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert yarn.rope_scaling is not None and yarn.rope_scaling.rope_type == "yarn"  # kept, for the loader to refuse


@pytest.mark.parametrize(("raw", "message"), [
    ({**LLAMA3_8B_HF, "rope_theta": "big"}, "rope_theta='big' must be a positive number"),
    ({**LLAMA3_8B_HF, "rms_norm_eps": 0}, "rms_norm_eps=0 must be a positive number"),
    ({**LLAMA3_8B_HF, "hidden_act": "relu6"}, "hidden_act='relu6' is not an activation"),
    ({**LLAMA3_8B_HF, "rope_scaling": [1]}, "rope_parameters=[1] must be an object"),
    ({**LLAMA3_8B_HF, "rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": "8k"}},
     "original_max_position_embeddings='8k' must be an integer"),
])
def test_bad_numerics_named(tmp_path: Path, raw: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read(tmp_path, raw)
