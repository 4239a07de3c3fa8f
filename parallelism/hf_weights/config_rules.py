"""config.json settings our model does not compute as transformers does, so weights loaded
under them would give other logits: refused by name before any tensor is read. Pure."""
from __future__ import annotations

from typing import Any

from parallelism.hf_weights.errors import HFWeightsError
from parallelism.layout.model_config import ModelConfig

COMPUTED_ROPE = ("llama3",)  # non-default RoPE types the trainer computes (parallelism/training/layers.py)


def check_computable(raw: dict[str, Any], config: ModelConfig, path: str) -> None:
    """Raise HFWeightsError naming the first setting of config.json at `path` that the trainer
    would compute differently from transformers."""
    model_type, c = raw.get("model_type"), config.llm

    def refuse(rule: str) -> HFWeightsError:
        return HFWeightsError(f"{path}: {rule} (model_type {model_type!r}); the trainer's logits would differ "
                              f"from transformers', so its weights are not loaded")

    if c.rope_scaling is not None and c.rope_scaling.rope_type not in COMPUTED_ROPE:
        raise refuse(f"rope_type {c.rope_scaling.rope_type!r} is not implemented (default and "
                     f"{', '.join(COMPUTED_ROPE)} are)")
    params = raw.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise refuse(f"partial_rotary_factor={factor!r}: only full-width RoPE is implemented")
    if raw.get("use_sliding_window") or (model_type == "mixtral" and raw.get("sliding_window") is not None):
        raise refuse(f"sliding_window={raw.get('sliding_window')!r}: sliding-window attention is not implemented "
                     f"(every position attends to all earlier ones)")
    kinds = set(raw.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise refuse(f"layer_types {sorted(kinds)}: only full_attention layers are implemented")
    if model_type == "gpt2":
        if raw.get("scale_attn_weights", True) is not True:
            raise refuse("scale_attn_weights=false: attention is always scaled by 1/sqrt(head_dim)")
        if raw.get("scale_attn_by_inverse_layer_idx"):
            raise refuse("scale_attn_by_inverse_layer_idx=true is not implemented")
        if raw.get("add_cross_attention"):
            raise refuse("add_cross_attention=true: a decoder-only model has no cross-attention")
