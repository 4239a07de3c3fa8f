"""The compare page's figures, settings table and CSV as pure functions of runs."""
from __future__ import annotations

import csv
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.compare_figures import (
    BREAKDOWN,
    CSV_COLUMNS,
    GIB,
    compare_csv,
    compare_figures,
    config_labels,
    memory_figure,
    settings_table,
    step_breakdown_figure,
    throughput_figure,
)


def run(layout: str, *, state: str = "done", pp: int = 1, gpu: str = "h100", step: float = 0.01, **settings_) -> dict:
    base = {"id": len(layout), "model": "tiny-gpt", "layout": layout, "gpus": 4, "gpu_type": gpu, "global_batch": 8,
            "micro_batch": 1, "seq_len": 64, "recompute": "none", "state": state, "error": "", "message": ""}
    base.update(settings_)
    if state == "done":
        base["result"] = {
            "step_seconds": step, "tokens_per_second": 512 / step, "model_tflops_per_gpu": 1.5,
            "hardware_tflops_per_gpu": 2.0, "mfu": 0.25,
            "breakdown": {"compute": step * 0.6, "tp_comm": step * 0.2, "dp_comm": step * 0.1, "pp_comm": step * 0.05,
                          "bubble": step * 0.05},
            "memory": {"peak_bytes": 3 * GIB, "capacity_bytes": 80 * GIB, "fits": True,
                       "per_stage": [{"stage": s, "params": GIB, "grads": GIB, "optimizer": GIB // 2,
                                      "activations": GIB // 4, "temporary": 0, "peak": 3 * GIB} for s in range(pp)]},
        }
    else:
        base["result"] = {}
    return base


def test_step_breakdown_stacks_the_five_parts_per_configuration_in_ms() -> None:
    runs = [run("tp=4", step=0.02), run("dp=4", state="running"), run("tp=2,pp=2", step=0.01)]
    fig = step_breakdown_figure(runs)
    bars = [t for t in fig["data"] if t["type"] == "bar"]
    assert [t["name"] for t in bars] == ["compute", "TP comm", "DP comm", "PP comm", "pipeline bubble"]
    assert fig["layout"]["barmode"] == "stack"
    assert bars[0]["x"] == ["#1 tp=4", "#2 dp=4", "#3 tp=2,pp=2"]
    assert bars[0]["y"][0] == pytest.approx(12.0) and bars[0]["y"][1] is None and bars[0]["y"][2] == pytest.approx(6.0)
    assert bars[1]["y"][0] == pytest.approx(4.0) and bars[1]["y"][1] is None
    # The stacked parts add up to the step time shown above each bar.
    total = next(t for t in fig["data"] if t["type"] == "scatter")
    assert sum(t["y"][0] for t in bars) == pytest.approx(total["y"][0]) == pytest.approx(20.0)
    assert total["text"] == ["20.0 ms", "", "10.0 ms"]  # the one formatter (format.js / formatting.py)


def test_memory_has_one_bar_per_stage_and_the_capacity_line_per_gpu_type() -> None:
    runs = [run("pp=2,dp=2", pp=2), run("dp=4", gpu="a100"), run("tp=4", state="failed")]
    fig = memory_figure(runs)
    params = next(t for t in fig["data"] if t["name"] == "params")
    assert params["x"] == [["#1 pp=2,dp=2", "#1 pp=2,dp=2", "#2 dp=4", "#3 tp=4"], ["stage 0", "stage 1", "stage 0", "–"]]
    assert params["y"] == [1.0, 1.0, 1.0, None]
    peak = next(t for t in fig["data"] if t["name"] == "peak")
    assert peak["y"] == [3.0, 3.0, 3.0, None]
    assert [s["y0"] for s in fig["layout"]["shapes"]] == [80.0, 80.0]
    assert [a["text"] for a in fig["layout"]["annotations"]] == ["a100 capacity 80.0 GiB", "h100 capacity 80.0 GiB"]


def test_a_capacity_far_above_every_peak_is_written_not_drawn() -> None:
    tiny = run("dp=4")
    for stage in tiny["result"]["memory"]["per_stage"]:
        stage["peak"] = GIB // 100
    fig = memory_figure([tiny])
    assert fig["layout"]["shapes"] == []
    assert fig["layout"]["yaxis"]["range"] == pytest.approx([0, 0.013], rel=0.01)
    assert fig["layout"]["annotations"][0]["text"] == "h100 capacity 80.0 GiB (above the scale: highest peak 0.012 % of it)"
    assert "range" not in memory_figure([run("dp=4")])["layout"]["yaxis"]  # 3 of 80 GiB: drawn to scale


def test_throughput_and_mfu_side_by_side() -> None:
    fig = throughput_figure([run("tp=4", step=0.5), run("dp=4", state="queued")])
    tokens, mfu = fig["data"]
    assert tokens["y"] == [1024.0, None] and (tokens["xaxis"], tokens["yaxis"]) == ("x", "y")
    assert mfu["y"] == [25.0, None] and (mfu["xaxis"], mfu["yaxis"]) == ("x2", "y2")
    assert fig["layout"]["xaxis"]["domain"][1] < fig["layout"]["xaxis2"]["domain"][0]


def test_settings_table_lists_what_differs_first() -> None:
    rows = settings_table([run("tp=4", micro_batch=2), run("dp=4")])
    assert [(r["setting"], r["differs"]) for r in rows[:2]] == [("layout", True), ("micro_batch", True)]
    assert rows[0]["values"] == ["tp=4", "dp=4"]
    assert all(not r["differs"] for r in rows[2:]) and len(rows) == 8


def test_csv_has_a_line_per_run_with_settings_and_figures() -> None:
    text = compare_csv([run("tp=4", step=0.02), run("dp=4", state="failed", error="layout: tp=3 does not divide")])
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert rows[0]["layout"] == "tp=4" and float(rows[0]["step_seconds"]) == 0.02
    assert float(rows[0]["compute"]) == pytest.approx(0.012) and rows[0]["fits"] == "True"
    assert rows[1]["state"] == "failed" and rows[1]["step_seconds"] == "" and "does not divide" in rows[1]["error"]


def test_empty_comparison_draws_empty_figures() -> None:
    figs = compare_figures([])
    assert all(r["values"] == [] and not r["differs"] for r in figs["settings"])
    assert all(t["x"] in ([], [[], []]) for t in figs["breakdown"]["data"])


states = st.sampled_from(["queued", "running", "done", "failed"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), states, st.floats(1e-4, 10.0)), max_size=6))
def test_figures_keep_every_configuration_in_place(specs) -> None:
    runs = [run(f"pp={pp},dp=1", pp=pp, state=state, step=step) for pp, state, step in specs]
    labels = config_labels(runs)
    assert len(set(labels)) == len(runs)
    for trace in step_breakdown_figure(runs)["data"]:
        assert trace["x"] == labels and len(trace["y"]) == len(runs)
    bars = [t for t in step_breakdown_figure(runs)["data"] if t["type"] == "bar"]
    for i, (pp, state, step) in enumerate(specs):
        parts = [t["y"][i] for t in bars]
        assert (None not in parts) == (state == "done")
        if state == "done":
            assert sum(parts) == pytest.approx(step * 1e3)
    memory = memory_figure(runs)["data"][0]
    expected = sum(pp if state == "done" else 1 for pp, state, _ in specs)
    assert len(memory["x"][0]) == len(memory["y"]) == expected
    assert len(list(csv.DictReader(io.StringIO(compare_csv(runs))))) == len(runs)
    assert set(BREAKDOWN) <= set(CSV_COLUMNS)


def test_runs_without_results_say_no_data_yet_instead_of_drawing_axes() -> None:
    figs = compare_figures([run("dp=4", state="queued"), run("tp=4", state="running")])
    for key in ("breakdown", "memory", "throughput"):
        layout = figs[key]["layout"]
        assert [a["text"] for a in layout["annotations"]] == ["no data yet"], key
        assert all(layout[k]["visible"] is False for k in layout if k.startswith(("xaxis", "yaxis"))), key
    done = compare_figures([run("dp=4"), run("tp=4", state="running")])
    assert done["breakdown"]["layout"]["yaxis"].get("visible", True) is True


@settings(max_examples=30, deadline=None)
@given(st.floats(1e-9, 1e5))
def test_no_compare_figure_prints_an_exponent(step: float) -> None:
    """Step times from nanoseconds to a day: texts through the formatter, axes without
    exponents (exponentformat none), room for rotated labels (automargin)."""
    import json
    import re

    figs = compare_figures([run("tp=2,pp=2,dp=1,zero=1", step=step, pp=2), run("dp=4", step=step * 3)])
    strings = re.findall(r'"((?:[^"\\]|\\.)*)"', json.dumps(figs, ensure_ascii=False))
    assert not [s for s in strings if re.search(r"\d(\.\d+)?e[+-]?\d", s, re.I) and not s.startswith("#")]
    assert not [s for s in strings if re.search(r"%\{[^}]*:[^}]*[eg]\}", s)]
    for key in ("breakdown", "memory", "throughput"):
        axes = [v for k, v in figs[key]["layout"].items() if k.startswith(("xaxis", "yaxis"))]
        assert axes and all(a["automargin"] and a["exponentformat"] == "none" for a in axes)
