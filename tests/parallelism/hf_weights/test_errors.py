"""Every refusal names the file (or checkpoint), the tensor and the rule, as HFWeightsError (a
ValueError), and on load it comes before any tensor data is read."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallelism.hf_weights import HFWeightsError, export_hf, export_hf_from_checkpoint, hf_initial_shards
from parallelism.hf_weights.load import RegionFiles, hf_model_config
from parallelism.layout.errors import LayoutError
from parallelism.layout.catalog import get_config, get_model, model_from_config
from parallelism.layout.model_config import DecoderConfig, ModelConfig
from parallelism.layout.placement import place
from tests.parallelism.hf_weights.conftest import LLAMA3_ROPE

WHOLE = "tp=1,pp=1,dp=1,zero=0"
READS = {"test_known_extras_are_ignored"}  # the tests whose loads succeed, so read data


@pytest.fixture
def copy(hf_dir, tmp_path: Path):
    """A writable copy of a case's directory."""
    def make(case: str) -> Path:
        folder = tmp_path / case
        shutil.copytree(hf_dir(case), folder)
        return folder
    return make


def edit_config(folder: Path, **changes) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def edit_weights(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def load(folder: Path | str, model=None, layout: str = WHOLE):
    """hf_initial_shards for the directory's own model (get_model reads the config.json there) or `model`."""
    model = model or get_model(str(folder), paths=True)
    return hf_initial_shards(place(model, layout), 0, str(folder))


def refused(match: str):
    return pytest.raises(HFWeightsError, match=match)


@pytest.fixture(autouse=True)
def _no_data_read_before_checks(monkeypatch, request) -> None:
    """Every load refusal here must come from the header checks: reading a region fails the test."""
    if request.node.originalname in READS:
        return

    def read(*_args):
        raise AssertionError("tensor data read before the checks were done")

    monkeypatch.setattr(RegionFiles, "read", read)


def test_is_a_value_error() -> None:
    assert issubclass(HFWeightsError, ValueError)


def test_config_shape_disagrees_with_the_weights(copy) -> None:
    folder = copy("qwen3")
    model = get_model(str(folder))  # the model as saved
    edit_config(folder, intermediate_size=48)
    with refused(r"model\.safetensors: model\.layers\.0\.mlp\.gate_proj\.weight has shape \(64, 32\) but "
                 r"config\.json implies \(48, 32\)"):
        load(folder, get_model(str(folder / "config.json")))
    with refused(r"config\.json: llm\.layers\.0\.mlp\.gate\.weight has shape \(48, 32\) there, \(64, 32\)"):
        load(folder, model)  # the placement's model (the old config) against the edited config.json


def test_missing_shard_file(copy) -> None:
    folder = copy("llama")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1  # the case is a sharded save
    shards[-1].unlink()
    with refused(rf"{shards[-1].name}: missing shard file \(listed in model\.safetensors\.index\.json for '"):
        load(folder)


def test_index_places_a_tensor_in_a_file_without_it(copy) -> None:
    folder = copy("llama")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == files[0])
    index["weight_map"][name] = files[1]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with refused(rf"{files[1]}: has no tensor '{name}', which model\.safetensors\.index\.json places there"):
        load(folder)


def test_missing_tensor(copy) -> None:
    folder = copy("mixtral")
    edit_weights(folder, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    with refused(r"model\.safetensors: missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight' "
                 r"of shape \(64, 32\)"):
        load(folder)


def test_unknown_tensor(copy) -> None:
    folder = copy("gpt2")
    edit_weights(folder, lambda t: t.update({"transformer.h.0.attn.c_extra.weight": torch.zeros(2)}))
    with refused(r"model\.safetensors: tensor 'transformer\.h\.0\.attn\.c_extra\.weight' is not a weight of this "
                 r"gpt2 model"):
        load(folder)


def test_known_extras_are_ignored(copy) -> None:
    """Buffers old checkpoints carry (GPT-2's attn.bias mask, rotary inv_freq) and a tied model's
    stored head are not weights we load: accepted, not read."""
    folder = copy("gpt2")
    edit_weights(folder, lambda t: t.update({"transformer.h.0.attn.bias": torch.ones(1, 1, 4, 4),
                                             "lm_head.weight": t["transformer.wte.weight"].clone()}))
    assert load(folder) is not None


def test_unsupported_model_type(copy) -> None:
    folder = copy("llama")
    edit_config(folder, model_type="mistral")
    with refused(r"config\.json: unsupported model_type 'mistral': read as a model \(to train from scratch, to "
                 r"emulate\), its weights have no adapter \(supported: llama, qwen2"):
        load(folder, get_model("tiny-gpt"))
    edit_config(folder, model_type="bert")
    with refused(r"config\.json: unsupported model_type 'bert' \(supported: llama, qwen2"):
        load(folder, get_model("tiny-gpt"))


@pytest.mark.parametrize(("vocab", "side"), [(100, "larger"), (200, "smaller")])
def test_vocab_of_config_and_weights_differ(copy, vocab: int, side: str) -> None:
    folder = copy("llama-bf16")
    edit_config(folder, vocab_size=vocab)
    with refused(rf"model\.safetensors: model\.embed_tokens\.weight has 128 rows but config\.json's vocab_size is "
                 rf"{vocab}: the weights' vocabulary is {side} than the config's"):
        load(folder)


@pytest.mark.parametrize(("vocab", "side"), [(64, "larger"), (256, "smaller")])
def test_vocab_of_placement_and_checkpoint_differ(hf_dir, vocab: int, side: str) -> None:
    path = hf_dir("qwen3")
    config = get_config(path)
    other = ModelConfig("padded", config.family, DecoderConfig(**{
        **{f: getattr(config.llm, f) for f in DecoderConfig.__slots__}, "vocab": vocab}))
    with refused(rf"vocab_size 128, but 'padded' has a vocabulary of {vocab}: the checkpoint's vocabulary is {side}"):
        load(path, model_from_config(other))


def test_another_model(hf_dir) -> None:
    with refused(r"config\.json: describes another model than 'tiny-gpt'"):
        load(hf_dir("gpt2"), get_model("tiny-gpt"))


def test_no_weights(tmp_path: Path, hf_dir) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    shutil.copy(Path(hf_dir("llama-bf16")) / "config.json", folder)
    with refused(r"empty: no model\.safetensors nor model\.safetensors\.index\.json$"):
        load(folder)
    (folder / "pytorch_model.bin").write_bytes(b"")
    with refused(r"found pytorch_model\.bin, which is not read \(safetensors only\)"):
        load(folder)


def test_unreadable_file_and_dtype(copy) -> None:
    folder = copy("qwen2")
    edit_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}))
    with refused(r"model\.safetensors: model\.norm\.weight is stored as I32; weights must be one of F32, BF16"):
        load(folder)
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with refused(r"model\.safetensors: not a readable safetensors file"):
        load(folder)


@pytest.mark.parametrize(("changes", "rule"), [
    ({"rope_parameters": {**LLAMA3_ROPE, "rope_type": "yarn"}}, r"rope_type 'yarn' is not implemented"),
])
def test_settings_computed_otherwise_are_refused(copy, changes: dict, rule: str) -> None:
    folder = copy("qwen2")
    edit_config(folder, **changes)
    with refused(rf"config\.json: {rule}.*the trainer's logits would differ from transformers'"):
        load(folder)


@pytest.mark.parametrize(("family", "changes", "rule"), [
    ("qwen2", {"layer_types": ["chunked_attention", "full_attention"]},
     r"layer_types\[0\]='chunked_attention': only full_attention and sliding_attention layers are built"),
    ("qwen2", {"layer_types": ["full_attention"]}, r"layer_types has 1 entries for num_hidden_layers 2"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx=true"),
    ("gpt2", {"add_cross_attention": True}, r"add_cross_attention=True: a decoder-only model has no cross-attention"),
    ("qwen2", {"attn_logit_softcapping": 50.0}, r"key 'attn_logit_softcapping' not known for this model_type"),
])
def test_settings_that_change_the_model_are_refused_when_the_config_is_read(copy, family: str, changes: dict,
                                                                           rule: str) -> None:
    """The model, and so its weights: named before any tensor is read, whether the config is read
    as a model (get_model: LayoutError) or for its weights (hf_model_config: HFWeightsError)."""
    folder = copy(family)
    edit_config(folder, **changes)
    with pytest.raises(LayoutError, match=rf"config\.json: {rule}"):
        get_model(str(folder), paths=True)
    with refused(rf"config\.json: {rule}"):
        hf_model_config(str(folder))


# --- export ---------------------------------------------------------------------------


def tiny_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros(t.shape) for t in model_from_config(config).tensors}


def test_export_refusals(tmp_path: Path, hf_dir) -> None:
    config = get_config("tiny-gpt")
    tensors = tiny_tensors(config)
    with refused(r"no tensor 'llm\.final_norm\.weight' to export"):
        export_hf(str(tmp_path / "a"), {k: v for k, v in tensors.items() if k != "llm.final_norm.weight"},
                  config=config)
    with refused(r"llm\.head\.weight: shape \(512, 32\), but tiny-gpt has \(512, 64\)"):
        export_hf(str(tmp_path / "b"), {**tensors, "llm.head.weight": torch.zeros(512, 32)}, config=config)
    with refused(r"'llm\.extra\.weight' is not a tensor of tiny-gpt"):
        export_hf(str(tmp_path / "c"), {**tensors, "llm.extra.weight": torch.zeros(1)}, config=config)
    export_hf(str(tmp_path / "d"), tensors, config=config)
    with refused(r"d: already holds weights \(model\.safetensors\); export into an empty directory"):
        export_hf(str(tmp_path / "d"), tensors, config=config)
    with refused(r"tiny-vlm: has an image encoder"):
        export_hf(str(tmp_path / "e"), {}, config=get_config("tiny-vlm"))
    with refused(r"an export needs the model's config or a source directory"):
        export_hf(str(tmp_path / "f"), tensors)
    with refused(r"config\.json: describes another model than 'tiny-gpt'"):
        export_hf(str(tmp_path / "g"), tensors, config=config, source_dir=hf_dir("llama"))
    qwen2 = ModelConfig("no-bias", "qwen2", config.llm)  # qwen2 always has q/k/v biases
    with refused(r"no-bias: a qwen2 config\.json cannot describe this model"):
        export_hf(str(tmp_path / "h"), tensors, config=qwen2)
    with refused(r"family 'llava' has no Hugging Face adapter"):
        export_hf(str(tmp_path / "i"), tensors, config=ModelConfig("x", "llava", config.llm))


def test_export_from_checkpoint_refusals(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    config = get_config("tiny-gpt")
    with refused(r"nowhere: not a DCP checkpoint \(no \.metadata\)"):
        export_hf_from_checkpoint(str(tmp_path / "nowhere"), str(tmp_path / "out"), config=config)
    folder = str(tmp_path / "other")
    dcp.save({"llm.embed.weight/master": torch.zeros(3, 2)}, checkpoint_id=folder, no_dist=True)
    with refused(r"other: llm\.embed\.weight/master has shape \(3, 2\), 'tiny-gpt' \(512, 64\)"):
        export_hf_from_checkpoint(folder, str(tmp_path / "out"), config=config)
    folder = str(tmp_path / "partial")
    dcp.save({"llm.embed.weight/master": torch.zeros(512, 64)}, checkpoint_id=folder, no_dist=True)
    with refused(r"partial: no llm\.layers\.0\.attn_norm\.weight/master \(a checkpoint of another model"):
        export_hf_from_checkpoint(folder, str(tmp_path / "out"), config=config)
