"""Tiny Hugging Face checkpoints, built once per test session (tiny_hf.py), by case name."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.parallelism.hf_weights.tiny_hf import build_hf_model, save_hf_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
# case -> (model_type, save options): every family, a sharded save, a bf16 save, Llama 3.1's RoPE,
# and a Mixtral written with transformers 5's fused expert tensors.
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {"max_shard_size": "20KB"}),
    "llama-bf16": ("llama", {"dtype": torch.bfloat16}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),
    # a window of 4 keys on layer 1 (transformers: use_sliding_window from max_window_layers on)
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
    "mixtral": ("mixtral", {}),
    "mixtral-fused": ("mixtral", {"fused": True}),
    "qwen3_moe": ("qwen3_moe", {}),
    "gpt2": ("gpt2", {}),
}
MOE_CASES = ("mixtral", "mixtral-fused", "qwen3_moe")


def save_fused(kind: str, folder: Path) -> str:
    """The model's in-memory state dict (transformers 5: experts.gate_up_proj / experts.down_proj)
    written as model.safetensors, with its config.json."""
    from safetensors.torch import save_file

    model = build_hf_model(kind)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 128}')  # a companion file to copy
    return str(folder)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Iterator[Callable[[str], str]]:
    root = tmp_path_factory.mktemp("hf")
    made: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in made:
            kind, options = CASES[case]
            folder = root / case
            options = dict(options)
            if options.pop("fused", False):
                made[case] = save_fused(kind, folder)
            else:
                made[case] = save_hf_model(kind, folder, **options)
        return made[case]

    yield get


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
