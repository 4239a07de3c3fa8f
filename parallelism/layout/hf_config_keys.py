"""Which config.json keys dynaplane knows, per model_type: a key it does not know may change
the model (a window, a sink, a soft cap, a latent attention), so it is refused by name rather
than guessed. Pure data and one check; hf_config.py reads the values."""
from __future__ import annotations

from typing import Any, Callable

# Keys of transformers' PretrainedConfig and of generation that do not change what a training
# step computes or holds: token ids, dtype and version stamps, inference switches, labels.
# Dropout probabilities are run options (`emulate --attention-dropout/--hidden-dropout`), not
# read from a config: pre-training recipes set them (GPT-2's 0.1) and fine-tunes do not.
_IGNORED = frozenset({
    "architectures", "model_type", "_name_or_path", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "forced_bos_token_id", "forced_eos_token_id", "initializer_range", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "pruned_heads", "chunk_size_feed_forward",
    "is_decoder", "id2label", "label2id", "problem_type", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "auto_map", "use_bfloat16", "tf_legacy_loss",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    # the Llama 1/2 conversion's tensor-parallel slicing of its linear layers: the same function
    "pretraining_tp",
    # MoE losses and logging: a coefficient of the auxiliary load-balancing loss, whether the
    # router's logits are returned. Routing is traced balanced (docs/emulator.md).
    "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
})

_LLAMA = frozenset({"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "vocab_size", "tie_word_embeddings", "attention_bias", "hidden_act",
                    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                    "layer_types"})
_WINDOWED = frozenset({"sliding_window", "use_sliding_window", "max_window_layers"})  # Qwen2's optional window
KNOWN: dict[str, frozenset[str]] = {
    "llama": _LLAMA | {"mlp_bias"},
    "qwen2": _LLAMA | _WINDOWED,
    "qwen3": _LLAMA | _WINDOWED,
    "qwen3_moe": _LLAMA | _WINDOWED | {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                                       "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"},
    "mixtral": _LLAMA | {"sliding_window", "num_local_experts", "num_experts_per_tok"},
    "mistral": _LLAMA | {"sliding_window"},
    "gpt_oss": _LLAMA | {"sliding_window", "num_local_experts", "num_experts_per_tok", "swiglu_limit", "swiglu_alpha"},
    "nemotron": (_LLAMA - {"rms_norm_eps"}) | {"norm_eps", "partial_rotary_factor", "mlp_bias"},
    "gpt2": frozenset({"n_embd", "hidden_size", "n_head", "num_attention_heads", "n_layer", "num_hidden_layers",
                       "n_inner", "n_positions", "max_position_embeddings", "n_ctx", "vocab_size", "activation_function",
                       "layer_norm_epsilon", "tie_word_embeddings", "scale_attn_weights",
                       "scale_attn_by_inverse_layer_idx",  # checked: off
                       "reorder_and_upcast_attn"}),  # fp32 scores inside attention: the same function
}


LAYER_TYPES = ("full_attention", "sliding_attention")

# Keys that would change the model when set, accepted at their off value (an encoder-decoder's
# cross-attention is not a decoder-only model's).
_OFF = {"add_cross_attention": False, "is_encoder_decoder": False, "tie_encoder_decoder": False}


def check_keys(raw: dict[str, Any], model_type: str, fail: Callable[[str], Exception]) -> None:
    """Raise fail(message) for the first key `model_type`'s model would not honour: unknown keys,
    layer types other than full and sliding-window attention."""
    for key, off in _OFF.items():
        if raw.get(key, off) != off:
            raise fail(f"{key}={raw[key]!r}: a decoder-only model has no cross-attention or encoder")
    unknown = sorted(set(raw) - KNOWN[model_type] - _IGNORED - set(_OFF))
    if unknown:
        raise fail(f"{'keys' if len(unknown) > 1 else 'key'} {', '.join(map(repr, unknown))} not known for this "
                   "model_type: refused rather than guessed (it may change the model)")
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise fail(f"layer_types={types!r} must be a list")
        other = [(i, kind) for i, kind in enumerate(types) if kind not in LAYER_TYPES]
        if other:
            i, kind = other[0]
            raise fail(f"layer_types[{i}]={kind!r}: only {' and '.join(LAYER_TYPES)} layers are built")
    if model_type == "gpt2" and raw.get("scale_attn_weights", True) is not True:
        raise fail("scale_attn_weights=false: attention without the 1/sqrt(head_dim) scale is not built")
    if model_type == "gpt2" and raw.get("scale_attn_by_inverse_layer_idx", False) is not False:
        raise fail("scale_attn_by_inverse_layer_idx=true: attention scaled by 1/(layer + 1) is not built")
