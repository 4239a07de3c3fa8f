"""config.json for an export without a source directory: the Hugging Face config of one of our
DecoderConfigs, checked by reading it back (parallelism/layout/hf_config.py) into the same model."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from parallelism.hf_weights.errors import HFWeightsError
from parallelism.layout.catalog import build_model
from parallelism.layout.hf_config import load_hf_config
from parallelism.layout.model_config import DecoderConfig, ModelConfig

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel"}
DTYPE_JSON_NAMES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}  # safetensors' -> config.json's


def hf_config_dict(config: ModelConfig, model_type: str, dtype: str = "BF16") -> dict[str, Any]:
    """The config.json of `config` as a `model_type` model whose weights are stored in `dtype`
    (safetensors' name); HFWeightsError when that model_type cannot express the config."""
    c = config.llm
    if model_type == "gpt2":
        raw: dict[str, Any] = {
            "n_embd": c.hidden, "n_layer": c.layers, "n_head": c.heads, "n_inner": c.ffn, "n_positions": c.positions,
            "vocab_size": c.vocab, "layer_norm_epsilon": c.norm_eps, "activation_function": c.hidden_act or "gelu_new",
            "tie_word_embeddings": c.tied}
    else:
        raw = {
            "hidden_size": c.hidden, "num_hidden_layers": c.layers, "num_attention_heads": c.heads,
            "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "intermediate_size": c.ffn,
            "vocab_size": c.vocab, "rms_norm_eps": c.norm_eps, "hidden_act": c.hidden_act or "silu",
            "tie_word_embeddings": c.tied, "rope_theta": c.rope_theta,
            "rope_parameters": _rope_parameters(c), "max_position_embeddings": 4096,
            "attention_bias": c.qkv_bias or c.o_bias}
        if model_type == "llama":
            raw["mlp_bias"] = c.mlp_bias
        if model_type == "qwen2":
            raw.pop("attention_bias")
        if model_type == "mixtral":
            raw.update(num_local_experts=c.experts, num_experts_per_tok=c.top_k, intermediate_size=c.moe_ffn)
        if model_type == "qwen3_moe":
            raw.update(num_experts=c.experts, num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_ffn,
                       decoder_sparse_step=1, mlp_only_layers=sorted(c.dense_layers), norm_topk_prob=c.norm_topk_prob)
    raw = {"architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
           "dtype": DTYPE_JSON_NAMES.get(dtype, "bfloat16"), **raw}
    _check_round_trip(raw, config, model_type)
    return raw


def _rope_parameters(c: DecoderConfig) -> dict[str, Any]:
    if c.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": c.rope_theta}
    s = c.rope_scaling
    return {"rope_type": s.rope_type, "rope_theta": c.rope_theta, "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_positions}


def _check_round_trip(raw: dict[str, Any], config: ModelConfig, model_type: str) -> None:
    """config.json read back must give the same tensors and numerics, else the model_type cannot
    express the config (e.g. qwen2 has q/k/v biases and no o bias, whatever the config says)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(raw, f)
        back = load_hf_config(path).llm
    c = config.llm
    numerics = ("rope_theta", "rope_scaling", "norm_eps", "norm_topk_prob")
    act = c.hidden_act or ("gelu_new" if model_type == "gpt2" else "silu")
    same = all(getattr(back, k) == getattr(c, k) for k in numerics) and back.hidden_act == act
    ours = [(t.name, t.shape) for t in build_model(config).tensors]
    theirs = [(t.name, t.shape) for t in build_model(ModelConfig(config.name, config.family, back)).tensors]
    if not same or ours != theirs:
        raise HFWeightsError(f"{config.name}: a {model_type} config.json cannot describe this model "
                             f"(it reads back as {back})")
