"""config.json settings our model does not compute as transformers does, so weights loaded
under them would give other logits: refused by name before any tensor is read. Pure.
Settings that change the model itself (attention windows, layer types, partial RoPE keys
a family does not have, GPT-2's attention scalings) are refused earlier, when the config is
read (parallelism/layout/hf_config_keys.py)."""
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
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):  # inside rope_parameters: not read
        raise refuse(f"rope_parameters.partial_rotary_factor={params['partial_rotary_factor']!r}: only "
                     "full-width RoPE is implemented for this model_type's weights")
