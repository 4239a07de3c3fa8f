"""Per-family adapters: our logical tensor names and shapes <-> a Hugging Face state dict's,
for llama, qwen2, qwen3, qwen3_moe, mixtral and gpt2. Pure: names and shapes only.

No q/k permutation. Our RoPE rotates dims i and i + head_dim/2 together (rotate-half,
parallelism/training/layers.py apply_rope), which is what transformers' Llama, Qwen and
Mixtral compute on HF-format checkpoints: the interleaved-pair layout of Meta's original
consolidated.*.pth is permuted into rotate-half once by transformers' convert script, so
q_proj/k_proj in an HF checkpoint already have our row order. GPT-2 has no RoPE.

Shapes: every logical tensor's shape comes from the catalog's spec of the config
(parallelism/layout/catalog.build_model); an HF tensor's shape follows from it.
"""
from __future__ import annotations

import re

from parallelism.hf_weights.errors import HFWeightsError
from parallelism.hf_weights.pieces import HFMap, Piece, Variant
from parallelism.layout.catalog import build_model
from parallelism.layout.hf_config import WEIGHT_TYPES
from parallelism.layout.model_config import DecoderConfig, ModelConfig
from parallelism.layout.tensors import TensorSpec

MOE_TYPES = ("mixtral", "qwen3_moe")
# Each MoE family's per-expert names of our gate, up and down.
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
_LAYER = re.compile(r"^llm\.layers\.(\d+)\.(.+)$")


def model_type_of(family: str) -> str:
    """The HF model_type of a catalog family (gpt -> gpt2; the llama-like ones are their own)."""
    model_type = "gpt2" if family == "gpt" else family
    if model_type not in WEIGHT_TYPES:
        raise HFWeightsError(f"family {family!r} has no Hugging Face adapter (supported model_type: "
                             f"{', '.join(WEIGHT_TYPES)})")
    return model_type


def detect_variant(model_type: str, hf_names: list[str] | set[str]) -> Variant:
    """The spelling a checkpoint's names use (pieces.Variant), from the names alone."""
    if model_type == "gpt2":
        return Variant(prefix="transformer." if any(n.startswith("transformer.") for n in hf_names) else "")
    if model_type in MOE_TYPES and any(n.endswith(".experts.gate_up_proj") for n in hf_names):
        return Variant(experts="fused")
    return Variant()


def hf_map(config: DecoderConfig, model_type: str, variant: Variant = Variant()) -> HFMap:
    """The Pieces of every logical tensor of `config` in a `model_type` checkpoint spelt `variant`."""
    if model_type not in WEIGHT_TYPES:
        raise HFWeightsError(f"unsupported model_type {model_type!r} (supported: {', '.join(WEIGHT_TYPES)})")
    if (model_type == "gpt2") != (config.style == "gpt"):
        raise HFWeightsError(f"model_type {model_type!r} does not fit a {config.style}-style decoder")
    if variant.experts not in ("per_expert", "fused"):
        raise HFWeightsError(f"unknown experts layout {variant.experts!r} (per_expert or fused)")
    specs = build_model(ModelConfig("hf", model_type, config)).tensors
    rule = _gpt2_pieces if model_type == "gpt2" else _llama_pieces
    pieces = {t.name: rule(t, config, model_type, variant) for t in specs}
    ignored = [r"(^|\.)rotary_emb\.inv_freq$"]
    if model_type == "gpt2":
        ignored.append(r"(^|\.)attn\.(bias|masked_bias)$")  # causal-mask buffers of old GPT-2 checkpoints
    if config.tied:
        ignored.append(r"^lm_head\.weight$")  # some tied checkpoints store the head too: it is the embedding
    return HFMap(model_type, variant, pieces, tuple(ignored))


def _one(name: str, shape: tuple[int, ...]) -> tuple[Piece, ...]:
    return (Piece(name, shape),)


def _llama_pieces(t: TensorSpec, c: DecoderConfig, model_type: str, v: Variant) -> tuple[Piece, ...]:
    top = {"llm.embed.weight": "model.embed_tokens.weight", "llm.final_norm.weight": "model.norm.weight",
           "llm.head.weight": "lm_head.weight"}
    if t.name in top:
        return _one(top[t.name], t.shape)
    layer, rest = _layer(t.name)
    p = f"model.layers.{layer}."
    simple = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}
    if rest in simple:
        return _one(p + simple[rest], t.shape)
    if m := re.fullmatch(r"attn\.(q|k|v|o)\.(weight|bias)", rest):
        return _one(f"{p}self_attn.{m[1]}_proj.{m[2]}", t.shape)
    if m := re.fullmatch(r"attn\.(q|k)_norm\.weight", rest):
        return _one(f"{p}self_attn.{m[1]}_norm.weight", t.shape)
    if m := re.fullmatch(r"mlp\.(gate|up|down)\.(weight|bias)", rest):
        return _one(f"{p}mlp.{m[1]}_proj.{m[2]}", t.shape)
    # MoE: Mixtral's classic names live under block_sparse_moe; transformers 5 renames it mlp.
    block = f"{p}block_sparse_moe." if model_type == "mixtral" and v.experts == "per_expert" else f"{p}mlp."
    if rest == "moe.router.weight":
        return _one(f"{block}gate.weight", t.shape)
    if m := re.fullmatch(r"moe\.experts\.(gate|up|down)\.weight", rest):
        kind = ("gate", "up", "down").index(m[1])
        experts, ffn = t.shape[0], c.moe_ffn
        if v.experts == "fused":
            if kind == 2:
                return _one(f"{block}experts.down_proj", t.shape)
            # gate_up_proj [E, 2F, H]: gate rows [0, F), up rows [F, 2F) (transformers' Concatenate(dim=1))
            fused = (experts, 2 * ffn, t.shape[2])
            return (Piece(f"{block}experts.gate_up_proj", fused, dim=1, start=kind * ffn, stop=(kind + 1) * ffn),)
        name = _EXPERT_NAMES[model_type][kind]
        return tuple(Piece(f"{block}experts.{e}.{name}.weight", t.shape[1:], expert=e) for e in range(experts))
    raise HFWeightsError(f"{t.name}: no {model_type} name for this tensor")


def _gpt2_pieces(t: TensorSpec, c: DecoderConfig, model_type: str, v: Variant) -> tuple[Piece, ...]:
    P = v.prefix
    top = {"llm.embed.weight": f"{P}wte.weight", "llm.pos_embed.weight": f"{P}wpe.weight",
           "llm.final_norm.weight": f"{P}ln_f.weight", "llm.final_norm.bias": f"{P}ln_f.bias",
           "llm.head.weight": "lm_head.weight"}
    if t.name in top:
        return _one(top[t.name], t.shape)
    layer, rest = _layer(t.name)
    p = f"{P}h.{layer}."
    if m := re.fullmatch(r"ln(1|2)\.(weight|bias)", rest):
        return _one(f"{p}ln_{m[1]}.{m[2]}", t.shape)
    width = c.heads * c.head_dim
    if m := re.fullmatch(r"attn\.(q|k|v)\.(weight|bias)", rest):
        # c_attn is a Conv1D: weight [hidden, 3 * width] (in, out), q | k | v along the output dim.
        j = "qkv".index(m[1])
        if m[2] == "bias":
            return (Piece(f"{p}attn.c_attn.bias", (3 * width,), dim=0, start=j * width, stop=(j + 1) * width),)
        return (Piece(f"{p}attn.c_attn.weight", (c.hidden, 3 * width), dim=1, start=j * width,
                      stop=(j + 1) * width, transpose=True),)
    conv = {"attn.o": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    if m := re.fullmatch(r"(attn\.o|mlp\.fc1|mlp\.fc2)\.(weight|bias)", rest):
        name = f"{p}{conv[m[1]]}.{m[2]}"
        if m[2] == "bias":
            return _one(name, t.shape)
        return (Piece(name, t.shape[::-1], transpose=True),)  # Conv1D: HF holds the (in, out) transpose
    raise HFWeightsError(f"{t.name}: no gpt2 name for this tensor")


def _layer(name: str) -> tuple[int, str]:
    m = _LAYER.match(name)
    if m is None:
        raise HFWeightsError(f"{name}: not a decoder layer tensor")
    return int(m[1]), m[2]
