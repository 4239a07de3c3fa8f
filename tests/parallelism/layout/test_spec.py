"""Layout strings: the contract's examples parse, broken rules are named, round trips."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism.layout.errors import LayoutError
from parallelism.layout.spec import ModuleLayout, parse_layout


@pytest.mark.parametrize(
    ("text", "world", "modules"),
    [
        ("tp=8,pp=4,dp=4,zero=1", 128, ["model"]),
        ("tp=8,pp=8,dp=16,ep=8,zero=1", 1024, ["model"]),
        ("encoder:tp=1,dp=32;llm:tp=8,pp=2,dp=2", 32, ["encoder", "llm"]),
        ("encoder:tp=2,dp=4,ranks=0-7;llm:tp=8,pp=2,dp=2,ranks=8-39", 40, ["encoder", "llm"]),
    ],
)
def test_contract_examples(text: str, world: int, modules: list[str]) -> None:
    layout = parse_layout(text)
    assert layout.world == world
    assert [m.module for m in layout.modules] == modules


def test_missing_keys_default_to_one_and_zero_to_zero() -> None:
    module = parse_layout("dp=4").modules[0]
    assert (module.tp, module.pp, module.vpp, module.cp, module.ep, module.zero) == (1, 1, 1, 1, 1, 0)
    assert parse_layout("dp=4").world == 4


def test_rank_formula_offset_for_non_colocated() -> None:
    llm = parse_layout("encoder:tp=2,dp=4,ranks=0-7;llm:tp=8,pp=2,dp=2,ranks=8-39").module("llm")
    assert (llm.offset, llm.last_rank, llm.world) == (8, 39, 32)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("tp=0", "tp=0 must be a positive integer"),
        ("tp=two", "tp=two is not a non-negative integer"),
        ("zero=4", "zero=4 must be 0, 1, 2 or 3"),
        ("dp=4,ep=3", "ep=3 must divide dp*cp=4"),
        ("tp=2,tp=4", "given twice"),
        ("mp=2", "unknown key 'mp'"),
        ("tp", "is not key=value"),
        ("vpp=2", "vpp=2 needs pp > 1"),
        ("tp=2,dp=2,ranks=0-2", "holds 3 ranks but tp*pp*dp*cp=4"),
        ("a:tp=2,ranks=0-1;b:tp=2,ranks=1-2", "rank ranges overlap"),
        ("a:tp=2,ranks=0-1;b:tp=2", "for every module"),
        ("a:dp=4;b:dp=8", "colocated modules must span the same number of ranks"),
        ("a:dp=2;a:dp=2", "module names repeat"),
        ("dp=2;dp=2", "needs 'module:'"),
        ("Enc:dp=2", "module name 'Enc'"),
        ("tp=2,ranks=3-1", "ends before it starts"),
    ],
)
def test_broken_rules_are_named(text: str, message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("*", r"\*").replace("(", r"\(")):
        parse_layout(text)


def test_layout_error_is_a_value_error() -> None:
    assert issubclass(LayoutError, ValueError)


degrees = st.sampled_from([1, 2, 3, 4, 8])


@st.composite
def module_layouts(draw, name: str = "model", first_rank: int | None = None) -> ModuleLayout:
    tp, pp, dp, cp = draw(degrees), draw(degrees), draw(degrees), draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if (dp * cp) % e == 0]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    return ModuleLayout(module=name, tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, zero=draw(st.integers(0, 3)),
                        first_rank=first_rank)


@given(module_layouts())
def test_homogeneous_round_trip(module: ModuleLayout) -> None:
    text = module.to_string(with_module=False)
    parsed = parse_layout(text)
    assert parsed.modules == (module,)
    assert str(parsed) == text
    assert parsed.world == module.tp * module.pp * module.dp * module.cp


@given(st.data())
def test_non_colocated_round_trip(data) -> None:
    encoder = data.draw(module_layouts("encoder", first_rank=0))
    llm = data.draw(module_layouts("llm", first_rank=encoder.world + data.draw(st.integers(0, 3))))
    text = f"{encoder.to_string(True)};{llm.to_string(True)}"
    parsed = parse_layout(text)
    assert parsed.modules == (encoder, llm)
    assert str(parse_layout(str(parsed))) == str(parsed)
    assert parsed.world == llm.last_rank + 1
