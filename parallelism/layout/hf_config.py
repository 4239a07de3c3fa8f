"""Read a Hugging Face config.json into a catalog ModelConfig (llama, mistral, qwen2/3, qwen3_moe, mixtral,
nemotron, gpt_oss, gpt2). A key this module does not know for the model_type is refused by name (hf_config_keys.py)."""
from __future__ import annotations

import json
import os
from typing import Any

from parallelism.layout.errors import LayoutError
from parallelism.layout.hf_config_keys import check_keys
from parallelism.layout.model_config import ACTIVATIONS, DecoderConfig, ModelConfig, RopeScaling

SUPPORTED_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "nemotron", "gpt_oss",
                                    "gpt2")
# The model_types whose weights load and export (parallelism/hf_weights/families.py); the others
# are read as models (to train from scratch, to emulate) only.
WEIGHT_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt2")
# transformers' per-class defaults for keys a config.json may leave out (shape keys have none: they are required).
_TIED_DEFAULT = {"gpt2": True}  # every other supported class defaults to untied
_HEAD_DIM_DEFAULT = {"qwen3": 128, "qwen3_moe": 128}  # others: hidden // heads
_TOP_K_DEFAULT = {"mixtral": 2, "qwen3_moe": 8, "gpt_oss": 4}
_ROPE_THETA_DEFAULT = {"mixtral": 1e6, "mistral": 1e4, "gpt_oss": 150000.0}  # others: transformers' default_theta, 1e4
_NORM_EPS_DEFAULT = {"gpt_oss": 1e-5, "llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6, "qwen3_moe": 1e-6, "mixtral": 1e-5, "nemotron": 1e-5,
                     "gpt2": 1e-5}
_ACT_DEFAULT = {"nemotron": "relu2"}  # others: the style's own (silu, gelu_new)
_ROTARY_FRACTION_DEFAULT = 0.5  # NemotronConfig.partial_rotary_factor


class _Reader:
    """Typed access to one config dict; every error names the key, the model_type and the file."""

    def __init__(self, raw: dict[str, Any], path: str, model_type: str) -> None:
        self.raw, self.path, self.model_type = raw, path, model_type

    def fail(self, message: str) -> LayoutError:
        return LayoutError(f"{self.path}: {message} (model_type {self.model_type!r})")

    def get_int(self, *keys: str, default: int | None = None, minimum: int = 1) -> int:
        # Several keys: the spellings one value has across classes (n_embd / hidden_size); None counts as absent.
        key = next((k for k in keys if self.raw.get(k) is not None), None)
        if key is None:
            if default is None:
                raise self.fail(f"missing key {' or '.join(map(repr, keys))}")
            return default
        value = self.raw[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(f"{key}={value!r} must be an integer >= {minimum}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(f"{key}={value!r} must be true or false")
        return value

    def get_float(self, *keys: str, default: float, source: dict[str, Any] | None = None) -> float:
        raw = self.raw if source is None else source
        key = next((k for k in keys if raw.get(k) is not None), None)
        if key is None:
            return default
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.fail(f"{key}={value!r} must be a positive number")
        return float(value)

    def int_list(self, key: str) -> list[int]:
        value = self.raw.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.fail(f"{key}={value!r} must be a list of layer indices")
        return value


def load_hf_config(path: str) -> ModelConfig:
    """The ModelConfig a config.json describes; named by `_name_or_path`, else the file's directory."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{path}: cannot read a Hugging Face config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise LayoutError(f"{path}: a config.json must hold a JSON object, not {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise LayoutError(f"{path}: unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_TYPES)})")
    r = _Reader(raw, path, model_type)
    check_keys(raw, model_type, r.fail)
    name = raw.get("_name_or_path")
    if not isinstance(name, str) or not name:
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    llm = _gpt2(r) if model_type == "gpt2" else _llama_like(r)
    family = "gpt" if model_type == "gpt2" else model_type  # gpt2 shares the GPT layout (and names) with gpt3
    return ModelConfig(name, family, llm, description=f"{model_type} from {path}")


def _head_dim(r: _Reader, hidden: int, heads: int) -> int:
    default = _HEAD_DIM_DEFAULT.get(r.model_type)
    if default is None and r.raw.get("head_dim") is None and hidden % heads:
        raise r.fail(f"hidden size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim given")
    return r.get_int("head_dim", default=default or hidden // heads)


def _activation(r: _Reader, *keys: str) -> str:
    key = next((k for k in keys if r.raw.get(k) is not None), None)
    if key is None:
        return _ACT_DEFAULT.get(r.model_type, "")
    value = r.raw[key]
    if value not in ACTIVATIONS:
        raise r.fail(f"{key}={value!r} is not an activation the trainer computes ({', '.join(ACTIVATIONS)})")
    return value


def _rope(r: _Reader) -> tuple[float, RopeScaling | None]:
    """(base, scaling) from transformers 5's `rope_parameters` or the older top-level `rope_theta`
    with `rope_scaling`; rope types other than default are kept as RopeScaling."""
    params = r.raw.get("rope_parameters") or r.raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise r.fail(f"rope_parameters={params!r} must be an object")
    theta = r.get_float("rope_theta", default=_ROPE_THETA_DEFAULT.get(r.model_type, 1e4))  # older configs
    theta = r.get_float("rope_theta", default=theta, source=params)  # rope_parameters' own wins
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if not isinstance(kind, str):
        raise r.fail(f"rope_type={kind!r} must be a string")
    original = params.get("original_max_position_embeddings") or r.raw.get("max_position_embeddings") or 8192
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise r.fail(f"original_max_position_embeddings={original!r} must be an integer >= 1")
    return theta, RopeScaling(kind, r.get_float("factor", default=1.0, source=params),
                              r.get_float("low_freq_factor", default=1.0, source=params),
                              r.get_float("high_freq_factor", default=4.0, source=params), original)


def _llama_like(r: _Reader) -> DecoderConfig:
    mt = r.model_type
    hidden, layers = r.get_int("hidden_size"), r.get_int("num_hidden_layers")
    heads = r.get_int("num_attention_heads")
    kv = r.get_int("num_key_value_heads", default=heads)  # absent: plain multi-head attention, as in transformers
    if heads % kv:
        raise r.fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    experts = top_k = moe_ffn = 0
    dense: set[int] = set()
    if mt in ("mixtral", "gpt_oss"):  # every layer MoE, experts as wide as intermediate_size
        experts, moe_ffn = r.get_int("num_local_experts"), r.get_int("intermediate_size")
    elif mt == "qwen3_moe":
        # transformers 5 saves num_experts under its attribute_map name, num_local_experts.
        experts = r.get_int("num_experts", "num_local_experts", minimum=0)
        moe_ffn = r.get_int("moe_intermediate_size")
        step, only = r.get_int("decoder_sparse_step", default=1), set(r.int_list("mlp_only_layers"))
        # transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % step == 0.
        dense = {i for i in range(layers) if experts == 0 or i in only or (i + 1) % step}
    if experts:
        top_k = r.get_int("num_experts_per_tok", default=_TOP_K_DEFAULT[mt])
        if top_k > experts:
            raise r.fail(f"num_experts_per_tok {top_k} exceeds the {experts} experts")
    # An all-MoE model never reads the dense width, so intermediate_size is only required when some layer is dense.
    needs_ffn = experts == 0 or len(dense) > 0
    ffn = r.get_int("intermediate_size") if needs_ffn else r.get_int("intermediate_size", default=moe_ffn)
    attention_bias = r.get_bool("attention_bias", False)
    theta, scaling = _rope(r)
    head_dim = _head_dim(r, hidden, heads)
    nemotron, oss = mt == "nemotron", mt == "gpt_oss"
    return DecoderConfig(
        "llama", hidden, layers, heads, kv, head_dim, ffn, r.get_int("vocab_size"),
        tied=r.get_bool("tie_word_embeddings", _TIED_DEFAULT.get(mt, False)),
        qkv_bias=mt == "qwen2" or attention_bias,  # Qwen2 always has q/k/v biases (and never an o bias)
        o_bias=mt != "qwen2" and attention_bias,  # Llama/Qwen3 put attention_bias on o_proj too
        mlp_bias=mt in ("llama", "nemotron") and r.get_bool("mlp_bias", False),
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        experts=experts, top_k=top_k, moe_ffn=moe_ffn,
        dense_layers=frozenset(dense) if experts else frozenset(),
        rope_theta=theta, rope_scaling=scaling,
        norm_eps=r.get_float("norm_eps" if nemotron else "rms_norm_eps", default=_NORM_EPS_DEFAULT[mt]),
        norm_topk_prob=r.get_bool("norm_topk_prob", False) if mt == "qwen3_moe" else True,  # Mixtral: always
        hidden_act=_activation(r, "hidden_act"),
        # Nemotron: LayerNorm1P (weight + 1, a bias), an MLP without a gate, RoPE on part of each head
        gated_mlp=not nemotron, norm="layernorm" if nemotron else "rms",
        rotary_dim=_rotary_dim(r, head_dim) if nemotron else 0,
        **_windows(r, layers),
        # GPT-OSS: sinks on every attention, biased router and experts, its clamped SwiGLU
        attention_sinks=oss, moe_bias=oss,
        swiglu_limit=r.get_float("swiglu_limit", default=7.0) if oss else 0.0,
        swiglu_alpha=r.get_float("swiglu_alpha", default=1.702) if oss else 1.702,
    )


def _windows(r: _Reader, layers: int) -> dict:
    """sliding_window and the layers it applies to, as transformers reads them: `layer_types`
    where given (transformers 5 writes it), else Qwen2's use_sliding_window from layer
    max_window_layers on, else (Mistral, Mixtral) every layer when sliding_window is set."""
    window = r.raw.get("sliding_window")
    types = r.raw.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise r.fail(f"layer_types has {len(types)} entries for num_hidden_layers {layers}")
        chosen = {i for i, kind in enumerate(types) if kind == "sliding_attention"}
    elif "use_sliding_window" in r.raw:
        first = r.get_int("max_window_layers", default=0, minimum=0)
        chosen = set(range(first, layers)) if r.get_bool("use_sliding_window", False) else set()
    else:
        chosen = set(range(layers))
    if window is None or not chosen:
        return {}
    return {"sliding_window": r.get_int("sliding_window"), "window_layers": frozenset(chosen)}


def _rotary_dim(r: _Reader, head_dim: int) -> int:
    """The rotated dims of a head: int(head_dim x partial_rotary_factor), as transformers takes them."""
    params = r.raw.get("rope_parameters") or {}  # transformers 5 keeps it there
    fraction = r.get_float("partial_rotary_factor", default=_ROTARY_FRACTION_DEFAULT)
    if isinstance(params, dict):
        fraction = r.get_float("partial_rotary_factor", default=fraction, source=params)
    dims = int(head_dim * fraction)
    if fraction > 1 or dims < 2 or dims % 2:
        raise r.fail(f"partial_rotary_factor={fraction!r} gives {dims} rotated dims of head_dim {head_dim}: "
                     "must be an even number from 2 to head_dim")
    return 0 if dims == head_dim else dims


def _gpt2(r: _Reader) -> DecoderConfig:
    hidden, heads = r.get_int("n_embd", "hidden_size"), r.get_int("n_head", "num_attention_heads")
    if hidden % heads:
        raise r.fail(f"n_embd {hidden} is not a multiple of n_head {heads}")
    return DecoderConfig(
        "gpt", hidden, r.get_int("n_layer", "num_hidden_layers"), heads, heads, hidden // heads,
        r.get_int("n_inner", default=4 * hidden), r.get_int("vocab_size"),
        tied=r.get_bool("tie_word_embeddings", True), positions=r.get_int("n_positions", "max_position_embeddings"),
        qkv_bias=True, o_bias=True, mlp_bias=True,
        norm_eps=r.get_float("layer_norm_epsilon", default=_NORM_EPS_DEFAULT["gpt2"]),
        hidden_act=_activation(r, "activation_function"),
    )
