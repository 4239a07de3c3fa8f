"""Tiny model configs written to a folder for tests that train on CPU ranks."""
from __future__ import annotations

import json
from pathlib import Path


def write_tiny_gpt2_style(folder: Path) -> str:
    """A GPT-2-style decoder (LayerNorm, GELU, learned positions, plain multi-head attention),
    untied, small enough for CPU ranks: its config.json in `folder`, whose path is returned."""
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 256, "vocab_size": 256,
        "n_positions": 32, "tie_word_embeddings": False}))
    return str(folder)
