"""Layouts drawn per module on the job page (issue 8): frontend/layout_view.py gives every
rank its modules (`role`), one coordinate per module (`parts`), and a legend per module."""
from __future__ import annotations

from frontend.layout_view import module_legend, rank_coordinates

SLOTS = [{"rank": r, "node": f"node-{r // 2 + 1}", "gpu": r % 2} for r in range(4)]


def test_colocated_gpus_show_both_modules_coordinates() -> None:
    rows = rank_coordinates("encoder:dp=4;llm:tp=2,dp=2", SLOTS)
    assert [r["role"] for r in rows] == ["encoder+llm"] * 4
    # rank 3: encoder dp3; llm tp1 dp1 (rank = tp_rank + tp * dp_rank)
    assert rows[3]["parts"] == [{"module": "encoder", "text": "pp0 dp3 tp0"}, {"module": "llm", "text": "pp0 dp1 tp1"}]
    assert rows[3]["label"] == "encoder: pp0 dp3 tp0; llm: pp0 dp1 tp1"


def test_non_colocated_gpus_belong_to_one_module_each() -> None:
    rows = rank_coordinates("encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3", SLOTS)
    assert [r["role"] for r in rows] == ["encoder", "encoder", "llm", "llm"]
    assert [p["text"] for r in rows for p in r["parts"]] == ["pp0 dp0 tp0", "pp0 dp1 tp0", "pp0 dp0 tp0", "pp0 dp0 tp1"]
    assert rows[2]["node"] == "node-2" and rows[2]["label"] == "llm: pp0 dp0 tp0"


def test_a_rank_outside_every_module_and_homogeneous_layouts() -> None:
    rows = rank_coordinates("encoder:dp=1,ranks=0-0;llm:tp=2,ranks=1-2", SLOTS)
    assert rows[3]["role"] == "none" and rows[3]["parts"] == []  # rank 3 leaves in this layout
    plain = rank_coordinates("tp=2,dp=2", SLOTS)
    assert {r["role"] for r in plain} == {"all"} and module_legend("tp=2,dp=2") == []


def test_legend_names_each_modules_layout_and_ranks() -> None:
    assert module_legend("encoder:dp=2,zero=1,ranks=0-1;llm:tp=2,ranks=2-3") == [
        {"module": "encoder", "layout": "dp=2,zero=1", "ranks": "0-1", "colocated": False},
        {"module": "llm", "layout": "tp=2", "ranks": "2-3", "colocated": False}]
    assert module_legend("encoder:dp=4;llm:tp=2,pp=2") == [
        {"module": "encoder", "layout": "dp=4", "ranks": "0-3", "colocated": True},
        {"module": "llm", "layout": "tp=2,pp=2", "ranks": "0-3", "colocated": True}]
    assert module_legend("encoder:dp=1,ranks=0-0;llm:dp=1,ranks=1-1")[0]["ranks"] == "0"
