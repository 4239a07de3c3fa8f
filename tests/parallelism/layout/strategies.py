"""Hypothesis strategies: small random models (dense, MoE, multimodal) and layouts valid
for them, with uneven shapes (torch.chunk remainders, kv heads < tp, uneven pp)."""
from __future__ import annotations

from hypothesis import strategies as st

from parallelism.layout.spec import ModuleLayout
from parallelism.layout.tensors import Model, ModuleSpec, TensorSpec, TensorSplit


@st.composite
def modules(draw, name: str, with_experts: bool):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k <= heads and heads % k == 0]))
    layers = draw(st.integers(1, 5))
    experts = draw(st.sampled_from([2, 4, 8])) if with_experts else 0
    hd = draw(st.integers(1, 3))
    hidden = draw(st.integers(2, 9))
    ffn = draw(st.integers(1, 13))
    vocab = draw(st.integers(1, 17))
    spec = ModuleSpec(name, layers, heads, kv, experts)
    t: list[TensorSpec] = []

    def add(tname, shape, layer=None, place=None, tp_dim=None, units=None, ep=None):
        t.append(TensorSpec(f"{name}.{tname}", shape, TensorSplit(name, layer, place, tp_dim, units, ep)))

    tied = draw(st.booleans())
    add("embed.weight", (vocab, hidden), place="first+last" if tied else "first", tp_dim=0)
    for i in range(layers):
        add(f"layers.{i}.attn_norm.weight", (hidden,), layer=i)
        add(f"layers.{i}.attn.q.weight", (heads * hd, hidden), layer=i, tp_dim=0, units=heads)
        add(f"layers.{i}.attn.k.weight", (kv * hd, hidden), layer=i, tp_dim=0, units=kv)
        add(f"layers.{i}.attn.o.weight", (hidden, heads * hd), layer=i, tp_dim=1, units=heads)
        if experts:
            add(f"layers.{i}.moe.router.weight", (experts, hidden), layer=i)
            add(f"layers.{i}.moe.experts.up.weight", (experts, ffn, hidden), layer=i, tp_dim=1, ep=0)
            add(f"layers.{i}.moe.experts.down.weight", (experts, hidden, ffn), layer=i, tp_dim=2, ep=0)
        else:
            add(f"layers.{i}.mlp.up.weight", (ffn, hidden), layer=i, tp_dim=0)
            add(f"layers.{i}.mlp.down.weight", (hidden, ffn), layer=i, tp_dim=1)
    add("final_norm.weight", (hidden,), place="last")
    if not tied:
        add("head.weight", (vocab, hidden), place="last", tp_dim=0)
    return spec, t


@st.composite
def models(draw, kind: str | None = None):
    kind = kind or draw(st.sampled_from(["dense", "moe", "multimodal"]))
    if kind == "multimodal":
        enc, enc_t = draw(modules("encoder", False))
        llm, llm_t = draw(modules("llm", False))
        return Model("random-mm", "multimodal", (enc, llm), tuple(enc_t + llm_t))
    llm, llm_t = draw(modules("llm", kind == "moe"))
    return Model(f"random-{kind}", "llama", (llm,), tuple(llm_t))


@st.composite
def module_layouts(draw, spec: ModuleSpec, max_world: int, first_rank: int | None = None):
    tps = [t for t in (1, 2, 4, 8) if spec.num_heads % t == 0 and (spec.num_kv_heads % t == 0 or t % spec.num_kv_heads == 0)]
    tp = draw(st.sampled_from(tps))
    pp = draw(st.integers(1, min(spec.num_layers, 3)))
    vpp = draw(st.sampled_from([v for v in (1, 2) if pp > 1 and pp * v <= spec.num_layers] or [1]))
    room = max(1, max_world // (tp * pp))
    dp = draw(st.integers(1, min(room, 4)))
    cp = draw(st.sampled_from([c for c in (1, 2) if tp * pp * dp * c <= max(max_world, tp * pp * dp)]))
    eps = [e for e in (1, 2, 4, 8) if (dp * cp) % e == 0 and (not spec.num_experts or spec.num_experts % e == 0)]
    ep = draw(st.sampled_from(eps)) if spec.num_experts else 1
    return ModuleLayout(spec.name, tp, pp, vpp, dp, cp, ep, draw(st.integers(0, 3)), first_rank)


@st.composite
def layouts(draw, model: Model, max_world: int = 16) -> str:
    if len(model.modules) == 1 or draw(st.booleans()):
        if len(model.modules) == 1:
            return draw(module_layouts(model.modules[0], max_world)).to_string(False)
        # colocated: same world for every module
        enc = draw(module_layouts(model.modules[0], max_world))
        for _ in range(20):
            llm = draw(module_layouts(model.modules[1], max_world))
            if llm.world == enc.world:
                return f"{enc.to_string(True)};{llm.to_string(True)}"
        # fall back to the same degrees where valid, else non-colocated
    enc = draw(module_layouts(model.modules[0], max_world // 2, first_rank=0))
    llm = draw(module_layouts(model.modules[1], max_world // 2, first_rank=enc.world))
    return f"{enc.to_string(True)};{llm.to_string(True)}"
