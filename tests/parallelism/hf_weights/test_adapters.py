"""The per-family adapters (parallelism/hf_weights/families.py) as properties over random small
configs of every model_type and name variant: the map covers exactly our tensors with the
catalog's shapes, tiles every HF tensor exactly once, round-trips tensors both ways, reads any
box as the slice of the whole tensor, and its names give back their variant."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallelism.hf_weights.convert import from_hf, read_box, to_hf
from parallelism.hf_weights.families import detect_variant, hf_map
from parallelism.hf_weights.pieces import HFMap, Variant
from parallelism.layout.catalog import build_model
from parallelism.layout.hf_config import WEIGHT_TYPES
from parallelism.layout.model_config import DecoderConfig, ModelConfig

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def configs(draw) -> tuple[DecoderConfig, str, Variant]:
    """A DecoderConfig as hf_config makes it for a random model_type, and a name variant."""
    mt = draw(st.sampled_from(WEIGHT_TYPES))
    heads = draw(st.sampled_from([1, 2, 4]))
    kv = heads if mt == "gpt2" else draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    head_dim = draw(st.sampled_from([2, 4]))
    hidden = heads * head_dim if mt == "gpt2" else draw(st.integers(2, 6))
    layers, vocab, ffn = draw(st.integers(1, 3)), draw(st.integers(2, 9)), draw(st.integers(1, 5))
    tied = draw(st.booleans())
    if mt == "gpt2":
        prefix = draw(st.sampled_from(["transformer.", ""]))
        c = DecoderConfig("gpt", hidden, layers, heads, heads, head_dim, ffn, vocab, tied=tied,
                          positions=draw(st.integers(1, 5)), qkv_bias=True, o_bias=True, mlp_bias=True)
        return c, mt, Variant(prefix=prefix)
    bias = draw(st.booleans())
    experts = top_k = moe_ffn = 0
    dense: frozenset[int] = frozenset()
    if mt in ("mixtral", "qwen3_moe"):
        experts = draw(st.integers(2, 4))
        top_k, moe_ffn = draw(st.integers(1, experts)), draw(st.integers(1, 4))
        if mt == "qwen3_moe":
            dense = frozenset(draw(st.sets(st.integers(0, layers - 1), max_size=layers)))
    c = DecoderConfig("llama", hidden, layers, heads, kv, head_dim, ffn, vocab, tied=tied,
                      qkv_bias=mt == "qwen2" or bias, o_bias=mt != "qwen2" and bias,
                      mlp_bias=mt == "llama" and draw(st.booleans()), qk_norm=mt in ("qwen3", "qwen3_moe"),
                      experts=experts, top_k=top_k, moe_ffn=moe_ffn, dense_layers=dense)
    variant = Variant(experts=draw(st.sampled_from(["per_expert", "fused"])) if experts else "per_expert")
    return c, mt, variant


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def logical_shapes(hfmap: HFMap) -> dict[str, tuple[int, ...]]:
    return {name: hfmap.logical_shape(name) for name in hfmap.pieces}


@SETTINGS
@given(configs())
def test_map_is_the_catalogs_tensors(case) -> None:
    c, mt, variant = case
    hfmap = hf_map(c, mt, variant)
    specs = build_model(ModelConfig("m", mt, c)).tensors
    assert [t.name for t in specs] == list(hfmap.pieces)
    assert all(hfmap.logical_shape(t.name) == t.shape for t in specs)


@SETTINGS
@given(configs())
def test_every_hf_tensor_tiled_exactly_once(case) -> None:
    hfmap = hf_map(*case)
    for hf_name, parts in hfmap.by_hf_name().items():
        pieces = [p for _, p in parts]
        if len(pieces) == 1 and pieces[0].dim is None:
            assert pieces[0].logical_shape == (pieces[0].region_shape[::-1] if pieces[0].transpose
                                               else pieces[0].hf_shape)
            continue
        dims = {p.dim for p in pieces}
        assert len(dims) == 1 and None not in dims, hf_name  # a fused tensor is cut along one dim
        dim = dims.pop()
        spans = sorted((p.start, p.stop) for p in pieces)
        edges = [0] + [b for _, b in spans]
        assert [a for a, _ in spans] == edges[:-1] and edges[-1] == pieces[0].hf_shape[dim], (hf_name, spans)


@SETTINGS
@given(configs(), st.integers(0, 2**31))
def test_round_trips(case, seed: int) -> None:
    hfmap = hf_map(*case)
    ours = random_tensors(logical_shapes(hfmap), seed)
    hf = to_hf(hfmap, ours)
    assert {n: tuple(t.shape) for n, t in hf.items()} == hfmap.hf_shapes
    back = from_hf(hfmap, hf)
    assert back.keys() == ours.keys() and all(torch.equal(back[n], ours[n]) for n in ours)
    theirs = random_tensors(hfmap.hf_shapes, seed + 1)
    again = to_hf(hfmap, from_hf(hfmap, theirs))
    assert all(torch.equal(again[n], theirs[n]) for n in theirs)


@SETTINGS
@given(configs(), st.integers(0, 2**31), st.data())
def test_any_box_is_the_slice_of_the_whole(case, seed: int, data) -> None:
    hfmap = hf_map(*case)
    theirs = random_tensors(hfmap.hf_shapes, seed)
    whole = from_hf(hfmap, theirs)
    name = data.draw(st.sampled_from(sorted(hfmap.pieces)))
    ranges = []
    for n in hfmap.logical_shape(name):
        a = data.draw(st.integers(0, n))
        ranges.append((a, data.draw(st.integers(a, n))))
    box = read_box(hfmap.pieces[name], ranges, lambda hf_name, slices: theirs[hf_name][slices])
    expected = whole[name][tuple(slice(a, b) for a, b in ranges)]
    assert box.shape == expected.shape and torch.equal(box, expected)


@SETTINGS
@given(configs())
def test_names_give_back_their_variant(case) -> None:
    c, mt, variant = case
    hfmap = hf_map(c, mt, variant)
    names = list(hfmap.hf_shapes)
    moe = any(c.is_moe_layer(i) for i in range(c.layers))
    expected = variant if (moe or mt == "gpt2") else Variant()  # no expert tensor: nothing tells the layout
    assert detect_variant(mt, names) == expected
    assert len(names) == len(set(names))
    assert not any(hfmap.is_ignored(n) for n in names)


def test_save_pretrained_names_spelt_out() -> None:
    """A few names written out, as transformers 5.25's save_pretrained writes them (checked
    against real saves in test_logits.py, where any unknown or missing name is refused)."""
    moe = hf_map(DecoderConfig("llama", 8, 1, 2, 1, 4, 4, 10, experts=2, top_k=1, moe_ffn=3), "mixtral")
    assert [p.hf_name for p in moe.pieces["llm.layers.0.moe.experts.up.weight"]] == [
        "model.layers.0.block_sparse_moe.experts.0.w3.weight", "model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    fused = hf_map(DecoderConfig("llama", 8, 1, 2, 1, 4, 4, 10, experts=2, top_k=1, moe_ffn=3, qk_norm=True),
                   "qwen3_moe", Variant(experts="fused"))
    (up,) = fused.pieces["llm.layers.0.moe.experts.up.weight"]
    assert (up.hf_name, up.hf_shape, up.dim, up.start, up.stop) == (
        "model.layers.0.mlp.experts.gate_up_proj", (2, 6, 8), 1, 3, 6)
    gpt2 = hf_map(DecoderConfig("gpt", 8, 1, 2, 2, 4, 32, 10, tied=True, positions=4, qkv_bias=True, o_bias=True,
                                mlp_bias=True), "gpt2", Variant(prefix="transformer."))
    (k,) = gpt2.pieces["llm.layers.0.attn.k.weight"]
    assert (k.hf_name, k.hf_shape, k.dim, k.start, k.stop, k.transpose) == (
        "transformer.h.0.attn.c_attn.weight", (8, 24), 1, 8, 16, True)
    assert gpt2.is_ignored("lm_head.weight") and gpt2.is_ignored("transformer.h.0.attn.bias")
