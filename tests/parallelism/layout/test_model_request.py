"""Requests resolve their model once, when made, and carry the value (NamesAModel)."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from parallelism.emulator.emulate import EmulateRequest
from parallelism.emulator.errors import EmulatorError
from parallelism.layout.catalog import get_config, get_model
from parallelism.layout.errors import LayoutError
from parallelism.training.parallel import TrainConfig


def _store(root, name: str, layers: int) -> None:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}))


def test_a_request_carries_the_model_it_named_when_it_was_made(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DYNAPLANE_MODELS_DIR", str(tmp_path))
    _store(tmp_path, "mine", layers=2)
    request = TrainConfig(model="mine")
    assert request.model_config.llm.layers == 2 and request.tensors.modules[-1].num_layers == 2
    _store(tmp_path, "mine", layers=3)  # edited in place while the request runs
    stat = (tmp_path / "mine" / "config.json").stat()
    os.utime(tmp_path / "mine" / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert request.model_config.llm.layers == 2  # the request's model did not change under it
    assert TrainConfig(model="mine").model_config.llm.layers == 3  # a new request reads the new file


def test_replace_resolves_the_new_name_and_equality_ignores_the_value() -> None:
    tied = dataclasses.replace(TrainConfig(model="tiny-gpt"), model="tiny-gpt-tied")
    assert tied.model_config == get_config("tiny-gpt-tied") and tied.tensors is get_model("tiny-gpt-tied")
    assert TrainConfig(model="tiny-gpt") == TrainConfig(model="tiny-gpt")
    assert "model_config" not in repr(tied)


def test_an_unknown_model_is_refused_when_the_request_is_made_in_the_callers_error_type() -> None:
    with pytest.raises(LayoutError, match="unknown model 'nope'"):
        TrainConfig(model="nope")
    with pytest.raises(EmulatorError, match="unknown model 'nope'"):
        EmulateRequest("nope", "dp=1", 1, "h100", 8, 1, 16)
    with pytest.raises(TypeError):  # the value is derived, never passed
        TrainConfig(model="tiny-gpt", model_config=get_config("tiny-gpt-tied"))
