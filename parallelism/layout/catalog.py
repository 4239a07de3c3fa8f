"""Model catalog: named architectures (or a Hugging Face config.json) as logical tensors.
The configs themselves are model_config.py's (re-exported here for the callers)."""
from __future__ import annotations

import functools
import os
import re
from dataclasses import replace

from parallelism.layout.errors import LayoutError, require
from parallelism.layout.hf_config import load_hf_config
from parallelism.layout.model_config import NORMS, DecoderConfig, ModelConfig, VisionConfig
from parallelism.layout.tensors import Model, ModuleSpec, Place, TensorSpec, TensorSplit


def _t(name: str, shape: tuple[int, ...], module: str, *, layer: int | None = None, place: Place | None = None,
       tp_dim: int | None = None, tp_units: int | None = None, ep_dim: int | None = None) -> TensorSpec:
    return TensorSpec(name, shape, TensorSplit(module, layer, place, tp_dim, tp_units, ep_dim))


def _gpt_layer(p: str, mod: str, i: int, h: int, heads: int, hd: int, ffn: int) -> list[TensorSpec]:
    """One pre-LN transformer layer with biases everywhere (GPT decoder and ViT encoder alike)."""
    q = heads * hd
    out = [_t(f"{p}ln1.weight", (h,), mod, layer=i), _t(f"{p}ln1.bias", (h,), mod, layer=i)]
    for proj in ("q", "k", "v"):
        out.append(_t(f"{p}attn.{proj}.weight", (q, h), mod, layer=i, tp_dim=0, tp_units=heads))
        out.append(_t(f"{p}attn.{proj}.bias", (q,), mod, layer=i, tp_dim=0, tp_units=heads))
    out += [
        _t(f"{p}attn.o.weight", (h, q), mod, layer=i, tp_dim=1, tp_units=heads),
        _t(f"{p}attn.o.bias", (h,), mod, layer=i),  # added once after the TP all-reduce: replicated
        _t(f"{p}ln2.weight", (h,), mod, layer=i), _t(f"{p}ln2.bias", (h,), mod, layer=i),
        _t(f"{p}mlp.fc1.weight", (ffn, h), mod, layer=i, tp_dim=0),
        _t(f"{p}mlp.fc1.bias", (ffn,), mod, layer=i, tp_dim=0),
        _t(f"{p}mlp.fc2.weight", (h, ffn), mod, layer=i, tp_dim=1),
        _t(f"{p}mlp.fc2.bias", (h,), mod, layer=i),
    ]
    return out


def _norm(name: str, c: DecoderConfig, **where) -> list[TensorSpec]:
    """A llama-style norm's tensors: RMSNorm's weight, LayerNorm's weight and bias."""
    out = [_t(f"{name}.weight", (c.hidden,), "llm", **where)]
    return out + ([_t(f"{name}.bias", (c.hidden,), "llm", **where)] if c.norm == "layernorm" else [])


def _llama_layer(c: DecoderConfig, i: int) -> list[TensorSpec]:
    p, h, hd = f"llm.layers.{i}.", c.hidden, c.head_dim
    out = _norm(f"{p}attn_norm", c, layer=i)
    for proj, units in (("q", c.heads), ("k", c.kv_heads), ("v", c.kv_heads)):
        out.append(_t(f"{p}attn.{proj}.weight", (units * hd, h), "llm", layer=i, tp_dim=0, tp_units=units))
        if c.qkv_bias:
            out.append(_t(f"{p}attn.{proj}.bias", (units * hd,), "llm", layer=i, tp_dim=0, tp_units=units))
    if c.qk_norm:
        out += [_t(f"{p}attn.{n}_norm.weight", (hd,), "llm", layer=i) for n in ("q", "k")]
    out.append(_t(f"{p}attn.o.weight", (h, c.heads * hd), "llm", layer=i, tp_dim=1, tp_units=c.heads))
    if c.o_bias:
        out.append(_t(f"{p}attn.o.bias", (h,), "llm", layer=i))
    if c.attention_sinks:  # one per query head: split over tp with the heads
        out.append(_t(f"{p}attn.sinks", (c.heads,), "llm", layer=i, tp_dim=0, tp_units=c.heads))
    out += _norm(f"{p}mlp_norm", c, layer=i)
    if c.is_moe_layer(i):
        e, f, b = c.experts, c.moe_ffn, c.moe_bias
        out.append(_t(f"{p}moe.router.weight", (e, h), "llm", layer=i))  # tiny and needed whole by every TP rank
        if b:
            out.append(_t(f"{p}moe.router.bias", (e,), "llm", layer=i))
        for proj in ("gate", "up"):
            out.append(_t(f"{p}moe.experts.{proj}.weight", (e, f, h), "llm", layer=i, tp_dim=1, ep_dim=0))
            if b:
                out.append(_t(f"{p}moe.experts.{proj}.bias", (e, f), "llm", layer=i, tp_dim=1, ep_dim=0))
        out.append(_t(f"{p}moe.experts.down.weight", (e, h, f), "llm", layer=i, tp_dim=2, ep_dim=0))
        if b:  # added once after the tp reduction: replicated over tp
            out.append(_t(f"{p}moe.experts.down.bias", (e, h), "llm", layer=i, ep_dim=0))
        return out
    for proj in ("gate", "up") if c.gated_mlp else ("up",):
        out.append(_t(f"{p}mlp.{proj}.weight", (c.ffn, h), "llm", layer=i, tp_dim=0))
        if c.mlp_bias:
            out.append(_t(f"{p}mlp.{proj}.bias", (c.ffn,), "llm", layer=i, tp_dim=0))
    out.append(_t(f"{p}mlp.down.weight", (h, c.ffn), "llm", layer=i, tp_dim=1))
    if c.mlp_bias:
        out.append(_t(f"{p}mlp.down.bias", (h,), "llm", layer=i))
    return out


def _decoder_tensors(c: DecoderConfig) -> list[TensorSpec]:
    require(c.style in ("llama", "gpt"), f"unknown decoder style {c.style!r}")
    embed_place: Place = "first+last" if c.tied else "first"  # tied: one logical tensor on both end stages
    out = [_t("llm.embed.weight", (c.vocab, c.hidden), "llm", place=embed_place, tp_dim=0)]
    if c.style == "gpt":
        out.append(_t("llm.pos_embed.weight", (c.positions, c.hidden), "llm", place="first"))
        for i in range(c.layers):
            out += _gpt_layer(f"llm.layers.{i}.", "llm", i, c.hidden, c.heads, c.head_dim, c.ffn)
        out += [_t("llm.final_norm.weight", (c.hidden,), "llm", place="last"),
                _t("llm.final_norm.bias", (c.hidden,), "llm", place="last")]
    else:
        require(c.norm in NORMS, f"unknown norm {c.norm!r} (known: {', '.join(NORMS)})")
        require(c.gated_mlp or not c.experts, "experts without a gate (down(act(up(x)))) are not built")
        require(0 <= c.rotary_dim <= c.head_dim and c.rotary_dim % 2 == 0,
                f"rotary_dim {c.rotary_dim} must be even and at most head_dim {c.head_dim}")
        for i in range(c.layers):
            out += _llama_layer(c, i)
        out += _norm("llm.final_norm", c, place="last")
    if not c.tied:
        out.append(_t("llm.head.weight", (c.vocab, c.hidden), "llm", place="last", tp_dim=0))
    return out


def _encoder_tensors(v: VisionConfig) -> list[TensorSpec]:
    d, m = v.hidden, "encoder"
    out = [
        _t("encoder.patch_embed.weight", (d, v.channels * v.patch * v.patch), m, place="first"),
        _t("encoder.cls_token", (1, d), m, place="first"),
        _t("encoder.pos_embed.weight", (v.positions, d), m, place="first"),
        _t("encoder.pre_norm.weight", (d,), m, place="first"),
        _t("encoder.pre_norm.bias", (d,), m, place="first"),
    ]
    for i in range(v.layers):
        out += _gpt_layer(f"encoder.layers.{i}.", m, i, d, v.heads, d // v.heads, v.mlp)
    # The projector runs right after the tower, so it lives on the encoder's last stage.
    h = v.proj_out
    return out + [
        _t("encoder.final_norm.weight", (d,), m, place="last"),
        _t("encoder.final_norm.bias", (d,), m, place="last"),
        _t("encoder.projector.fc1.weight", (h, d), m, place="last", tp_dim=0),
        _t("encoder.projector.fc1.bias", (h,), m, place="last", tp_dim=0),
        _t("encoder.projector.fc2.weight", (h, h), m, place="last", tp_dim=1),
        _t("encoder.projector.fc2.bias", (h,), m, place="last"),
    ]


def build_model(config: ModelConfig) -> Model:
    """The logical tensors of a config, in the one global order: encoder first, then llm."""
    c, v = config.llm, config.encoder
    require(c.heads % c.kv_heads == 0, f"{config.name}: heads {c.heads} not a multiple of kv_heads {c.kv_heads}")
    modules: list[ModuleSpec] = []
    tensors: list[TensorSpec] = []
    if v is not None:
        require(v.hidden % v.heads == 0, f"{config.name}: encoder hidden {v.hidden} not a multiple of {v.heads} heads")
        require(v.image % v.patch == 0, f"{config.name}: image {v.image} not a multiple of patch {v.patch}")
        modules.append(ModuleSpec("encoder", v.layers, v.heads, v.heads))
        tensors += _encoder_tensors(v)
    modules.append(ModuleSpec("llm", c.layers, c.heads, c.kv_heads, c.experts))
    tensors += _decoder_tensors(c)
    return Model(config.name, config.family, tuple(modules), tuple(tensors), config.description)


def _llama(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, head_dim: int = 0) -> DecoderConfig:
    return DecoderConfig("llama", hidden, layers, heads, kv, head_dim or hidden // heads, ffn, vocab)


_TINY = _llama(64, 4, 4, 2, 176, 512)
_LLAMA3_8B = _llama(4096, 32, 32, 8, 14336, 128256)
_LLAMA3_70B = _llama(8192, 80, 64, 8, 28672, 128256)
_CATALOG: dict[str, ModelConfig] = {c.name: c for c in (
    ModelConfig("tiny-gpt", "llama", _TINY, description="Llama-style toy model, trains on a CPU"),
    ModelConfig("tiny-gpt-tied", "llama", replace(_TINY, tied=True),
                description="tiny-gpt with its embedding and head tied (as Llama 3.2 1B/3B, Gemma, GPT-2)"),
    ModelConfig("tiny-gpt-5l", "llama", replace(_TINY, layers=5),
                description="tiny-gpt with 5 layers: an odd count, for interleaved pipelines' uneven chunks"),
    ModelConfig("tiny-moe", "qwen3_moe", replace(_TINY, qk_norm=True, experts=8, top_k=2, moe_ffn=32,
                                                 dense_layers=frozenset({0})),
                description="Qwen3-style toy MoE (8 experts, top-2, layer 0 dense), trains on a CPU"),
    ModelConfig("llama3-8b", "llama", _LLAMA3_8B, description="Llama 3 8B"),
    ModelConfig("llama3-70b", "llama", _LLAMA3_70B, description="Llama 3 70B"),
    ModelConfig("llama3-405b", "llama", _llama(16384, 126, 128, 8, 53248, 128256), description="Llama 3.1 405B"),
    ModelConfig("gpt3-175b", "gpt", DecoderConfig(
        "gpt", 12288, 96, 96, 96, 128, 4 * 12288, 50257, tied=True, positions=2048,
        qkv_bias=True, o_bias=True, mlp_bias=True), description="GPT-3 175B (tied embedding)"),
    ModelConfig("qwen3-235b-a22b", "qwen3_moe", replace(
        _llama(4096, 94, 64, 4, 12288, 151936, head_dim=128), qk_norm=True, experts=128, top_k=8, moe_ffn=1536),
        description="Qwen3 235B-A22B MoE, 128 experts top-8"),
    ModelConfig("llava-vitl-llama3-8b", "llava", _LLAMA3_8B, VisionConfig(1024, 24, 16, 4096, 14, 336, 3, 4096),
                description="CLIP ViT-L/14-336 + MLP projector + Llama 3 8B (LLaVA-NeXT 8B)"),
    # InternViT towers (published config.json of OpenGVLab/InternViT-6B-448px-V1-5: hidden 3200, 45 layers,
    # 25 heads, MLP 12800, patch 14, image 448; OpenGVLab/InternViT-300M-448px: hidden 1024, 24 layers, 16
    # heads, MLP 4096, patch 14, image 448) in this catalog's ViT form (pre-LN with biases, a class token,
    # no pixel shuffle: 1025 image tokens into the LLM), with an MLP projector: issue 8's benchmark models.
    ModelConfig("internvit6b-llama3-70b", "llava", _LLAMA3_70B, VisionConfig(3200, 45, 25, 12800, 14, 448, 3, 8192),
                description="InternViT-6B-448px (45 layers) + MLP projector + Llama 3 70B"),
    ModelConfig("internvit300m-llama3-8b", "llava", _LLAMA3_8B, VisionConfig(1024, 24, 16, 4096, 14, 448, 3, 4096),
                description="InternViT-300M-448px + MLP projector + Llama 3 8B"),
    ModelConfig("llama-124m", "llama", _llama(768, 12, 12, 4, 2048, 32000),
                description="Llama-style 124M model for switch benchmarks on one machine"),
    ModelConfig("tiny-vlm", "llava", _TINY, VisionConfig(32, 2, 2, 64, 4, 16, 3, 64),
                description="toy ViT + projector + tiny-gpt, for CPU tests"),
    ModelConfig("tiny-vlm-tied", "llava", replace(_TINY, tied=True), VisionConfig(32, 2, 2, 64, 4, 16, 3, 64),
                description="tiny-vlm with the LLM's embedding and head tied, for CPU tests"),
)}

# Published totals (model cards / papers) that tests hold the catalog to, within 0.5%.
PUBLISHED_PARAMS: dict[str, int] = {
    "llama3-8b": 8_030_000_000,
    "llama3-70b": 70_600_000_000,
    "llama3-405b": 405_000_000_000,
    "gpt3-175b": 175_000_000_000,
    "qwen3-235b-a22b": 235_000_000_000,
    "llava-vitl-llama3-8b": 8_360_000_000,
}


# Published vision-tower sizes (model cards: InternViT-6B-448px-V1-5 "Params (M): 5540", InternViT-300M-448px
# "Params (M): 304"): the encoder's tensors without the projector, within 0.5%.
PUBLISHED_ENCODER_PARAMS: dict[str, int] = {
    "internvit6b-llama3-70b": 5_540_000_000,
    "internvit300m-llama3-8b": 304_000_000,
}


def catalog_names() -> list[str]:
    return list(_CATALOG)


MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def models_dir() -> str:
    """Where stored model configs live: <name>/config.json under $DYNAPLANE_MODELS_DIR, else
    <$DYNAPLANE_VAR_DIR>/models, else ./var/models (the control plane and every agent of a
    cluster must see the same folder, as with checkpoints)."""
    explicit = os.environ.get("DYNAPLANE_MODELS_DIR")
    if explicit:
        return explicit
    return os.path.join(os.environ.get("DYNAPLANE_VAR_DIR") or "var", "models")


def stored_config_path(name: str) -> str | None:
    """The config.json stored under models_dir() for `name` (a plain name, never a path)."""
    if not MODEL_NAME_RE.match(name) or ".." in name:
        return None
    path = os.path.join(models_dir(), name, "config.json")
    return path if os.path.isfile(path) else None


def get_config(name_or_path: str, *, paths: bool = True) -> ModelConfig:
    """The architecture hyperparameters (incl. top_k, ffn widths) behind get_model's tensors:
    a catalog name, a config stored under models_dir(), or (`paths`: the CLI's case, never
    an API input) a path to a Hugging Face config.json or its folder. Errors about a stored
    config name it by its name, not by its place on the server."""
    if name_or_path in _CATALOG:
        return _CATALOG[name_or_path]
    stored = stored_config_path(name_or_path)
    if stored is not None:
        stat = os.stat(stored)
        try:
            return _load_hf(os.path.abspath(stored), stat.st_mtime_ns, stat.st_size)
        except LayoutError as exc:
            raise LayoutError(str(exc).replace(os.path.abspath(stored), f"stored model {name_or_path!r}")) from None
    if not paths:
        raise LayoutError(f"unknown model {name_or_path!r}: not a catalog name ({', '.join(_CATALOG)}) nor a "
                          f"stored model config (models/<name>/config.json)")
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        stat = os.stat(path)
        return _load_hf(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    raise LayoutError(f"unknown model {name_or_path!r}: not a catalog name ({', '.join(_CATALOG)}) "
                      f"nor a path to a Hugging Face config.json")


@functools.lru_cache(maxsize=64)
def _load_hf(path: str, mtime_ns: int, size: int) -> ModelConfig:
    # Keyed on mtime and size as well, so a config.json edited in place is read again.

    return load_hf_config(path)


@functools.lru_cache(maxsize=64)
def _build_cached(config: ModelConfig) -> Model:
    return build_model(config)  # models are immutable, and the big ones take ~10 ms to build


def model_from_config(config: ModelConfig) -> Model:
    """The model (tensors) of a resolved config, built once per config."""
    return _build_cached(config)


def get_model(name_or_path: str, *, paths: bool = True) -> Model:
    """A catalog model by name, a stored config's model, or (`paths`) the model a Hugging
    Face config.json (file or its directory) describes."""
    return _build_cached(get_config(name_or_path, paths=paths))


def model_summary(model: Model) -> dict[str, object]:
    """The headline numbers of a model, for `dynaplane models --json`; hidden/heads/vocab are the LLM's."""
    main = next((m for m in model.modules if m.name == "llm"), model.modules[-1])
    embed = next((t for t in model.tensors if t.name == f"{main.name}.embed.weight"), None)
    return {
        "name": model.name,
        "family": model.family,
        "description": model.description,
        "params": model.param_count,
        "tensors": len(model.tensors),
        "layers": {m.name: m.num_layers for m in model.modules},
        "hidden": embed.shape[1] if embed else None,
        "heads": main.num_heads,
        "kv_heads": main.num_kv_heads,
        "experts": main.num_experts,
        "vocab": embed.shape[0] if embed else None,
    }
