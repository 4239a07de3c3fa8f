"""The job pages' figures and helpers are pure functions of data."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallelism.layout.catalog import get_model
from controlplane.jobs.plan_preview import plan_preview
from frontend.figures import (
    band_shapes,
    history_bands,
    memory_wave_figure,
    metric_figure,
    plan_heatmap_figure,
    round_bytes_figure,
    step_time_around,
    wave_xs,
)
from frontend.layout_view import rank_coordinates


def _t(id_: int, src: str, dst: str, state: str, step: int | None) -> dict:
    return {"id": id_, "source_layout": src, "destination_layout": dst, "state": state, "step": step}


def test_history_bands_follow_the_committed_switches() -> None:
    transitions = [_t(1, "dp=2", "dp=4", "committed", 10), _t(2, "dp=4", "tp=2,dp=2", "aborted", None),
                   _t(3, "dp=4", "dp=3", "committed", 25)]
    assert history_bands("dp=3", transitions, 40) == [
        {"x0": 0.0, "x1": 10.0, "layout": "dp=2", "transition": None},
        {"x0": 10.0, "x1": 25.0, "layout": "dp=4", "transition": 1},
        {"x0": 25.0, "x1": 40.0, "layout": "dp=3", "transition": 3},
    ]


def test_history_bands_without_switches_is_one_band_and_never_runs_backwards() -> None:
    assert history_bands("dp=2", [], None) == [{"x0": 0.0, "x1": 0.0, "layout": "dp=2", "transition": None}]
    bands = history_bands("dp=4", [_t(1, "dp=2", "dp=4", "committed", 30)], 12)  # live points lag the switch
    assert bands[-1]["x0"] == bands[-1]["x1"] == 30.0


@given(st.lists(st.integers(1, 50), max_size=6), st.integers(0, 400))
def test_bands_tile_the_steps(gaps: list[int], extra: int) -> None:
    steps, at = [], 0
    for gap in gaps:
        at += gap
        steps.append(at)
    transitions = [_t(i, f"dp={i + 1}", f"dp={i + 2}", "committed", s) for i, s in enumerate(steps)]
    bands = history_bands("dp=1", transitions, at + extra)
    assert bands[0]["x0"] == 0 and bands[-1]["x1"] == at + extra
    assert all(a["x1"] == b["x0"] for a, b in zip(bands, bands[1:]))
    assert [b["layout"] for b in bands] == [f"dp={i + 1}" for i in range(len(steps) + 1)]


def test_metric_figure_has_one_extendable_trace_and_the_bands() -> None:
    bands = history_bands("dp=4", [_t(7, "dp=2", "dp=4", "committed", 3)], 5)
    figure = metric_figure("step_seconds", {"x": [1, 2, 3, 4, 5], "y": [.2, .2, .2, .1, .1]}, bands)
    assert len(figure["data"]) == 1 and figure["data"][0]["y"] == [.2, .2, .2, .1, .1]
    shapes = figure["layout"]["shapes"]
    assert [(s["x0"], s["x1"]) for s in shapes if s["type"] == "rect"] == [(0.0, 3.0), (3.0, 5.0)]
    # A marker (a vertical line) at the switch, and a label per band: the first layout, then the switch.
    assert [(s["x0"], s["x1"], s["name"]) for s in shapes if s["type"] == "line"] == [(3.0, 3.0, "switch 7")]
    assert [a["text"] for a in figure["layout"]["annotations"]] == ["dp=2", "#7 → dp=4"]
    empty = metric_figure("loss", None)
    assert empty["data"][0]["x"] == [] and empty["layout"]["shapes"] == []
    # An empty chart says so instead of drawing made-up axes.
    assert [a["text"] for a in empty["layout"]["annotations"]] == ["no data yet"]
    assert empty["layout"]["xaxis"]["visible"] is False and empty["layout"]["yaxis"]["visible"] is False
    shapes, notes = band_shapes([])
    assert shapes == notes == []


def test_step_time_around_skips_the_step_that_carried_the_pause() -> None:
    series = {"x": [1, 2, 3, 4, 5, 6, 7, 8], "y": [.4, .2, .2, .2, 3.0, .1, .1, .1]}
    assert step_time_around(series, 4, count=3) == (.2, .1)
    assert step_time_around(series, 8) == (.1, None)  # steps 4-8: .2, 3, .1, .1, .1
    assert step_time_around(None, 4) == (None, None) and step_time_around(series, None) == (None, None)


def test_plan_figures_from_a_real_plan() -> None:
    plan = plan_preview(get_model("tiny-gpt"), "dp=2", "dp=4", gpus_per_node=2, staging_bytes=2**20)
    heat = plan_heatmap_figure(plan["matrix"])
    z = heat["data"][0]["z"]
    assert len(z) == 4 and z[0][0] is None  # nothing sent to itself: blank
    assert sum(v or 0 for row in z for v in row) == plan["summary"]["network_bytes"]
    rounds = round_bytes_figure(plan["round_bytes"], plan["round_seconds"])
    assert rounds["data"][0]["x"] == list(range(1, plan["summary"]["rounds"] + 1))
    assert rounds["data"][0]["customdata"] == plan["round_seconds"]
    wave = memory_wave_figure(plan["wave_after"], plan["wave_peak"], capacity_bytes=2**40, measured={0: 123, 9: 1})
    predicted = [t for t in wave["data"] if t["mode"] == "lines"]
    assert len(predicted) == 4 and len(predicted[0]["x"]) == 1 + 2 * plan["summary"]["rounds"]
    assert max(max(t["y"]) for t in predicted) == plan["summary"]["predicted_peak_bytes"]
    assert predicted[2]["y"][0] == 0  # rank 2 joins empty
    measured = [t for t in wave["data"] if t["mode"] == "markers"]
    assert [t["y"] for t in measured] == [[123]]  # rank 9 is not in the world: dropped
    assert wave["layout"]["shapes"] == []  # 1 TiB capacity would flatten the waves
    assert memory_wave_figure(plan["wave_after"], plan["wave_peak"], capacity_bytes=2**24)["layout"]["shapes"]


def test_heatmap_of_a_huge_world_says_why_it_is_empty() -> None:
    figure = plan_heatmap_figure(None)
    assert figure["data"] == [] and "too many ranks" in figure["layout"]["annotations"][0]["text"]


@pytest.mark.parametrize("layout,rank,expected", [
    ("tp=2,pp=2,dp=2", 5, "pp1 dp0 tp1"), ("tp=2,pp=2,dp=2", 2, "pp0 dp1 tp0"), ("dp=4", 3, "pp0 dp3 tp0"),
    ("tp=2,cp=2", 3, "pp0 dp0 tp1 cp1"),
])
def test_rank_coordinates_follow_the_contract_rank_order(layout: str, rank: int, expected: str) -> None:
    slots = [{"rank": r, "node": f"n{r // 2}", "gpu": r % 2} for r in range(8)]
    rows = {row["rank"]: row for row in rank_coordinates(layout, slots)}
    assert rows[rank]["label"] == expected and rows[rank]["node"] == f"n{rank // 2}"


def test_rank_coordinates_of_heterogeneous_layouts_name_the_module() -> None:
    rows = rank_coordinates("encoder:tp=2,dp=1,ranks=0-1;llm:tp=2,pp=2,dp=1,ranks=2-5",
                            [{"rank": r, "node": "n", "gpu": r} for r in range(6)])
    assert rows[0]["label"] == "encoder: pp0 dp0 tp0" and rows[5]["label"] == "llm: pp1 dp0 tp1"
    assert rank_coordinates("dp=2", [{"rank": 3, "node": "n", "gpu": 0}])[0]["coordinates"] == []


def test_measured_waves_drawn_over_the_predicted_ones_as_far_as_the_transfer_got() -> None:
    plan = plan_preview(get_model("tiny-gpt"), "dp=2", "dp=4", gpus_per_node=2, staging_bytes=2**20)
    rounds = plan["summary"]["rounds"]
    full = [7] * (2 * rounds + 1)
    wave = memory_wave_figure(plan["wave_after"], plan["wave_peak"], measured_waves={"0": [5, 9, 6], "3": full,
                                                                                      "8": [1]})
    measured = {t["name"]: t for t in wave["data"] if t["name"].endswith("measured")}
    assert sorted(measured) == ["rank 0 measured", "rank 3 measured"]  # rank 8 is not in the world
    assert measured["rank 0 measured"]["x"] == [0.0, 0.5, 1.0] and measured["rank 0 measured"]["y"] == [5, 9, 6]
    assert measured["rank 3 measured"]["x"] == wave_xs(rounds) and measured["rank 3 measured"]["y"] == full
    predicted = {t["name"]: t for t in wave["data"] if t["name"].endswith("predicted")}
    for rank in (0, 3):  # the same colour as the rank's predicted line, dotted
        assert measured[f"rank {rank} measured"]["line"]["color"] == predicted[f"rank {rank} predicted"]["line"]["color"]
        assert measured[f"rank {rank} measured"]["line"]["dash"] == "dot"
    assert wave_xs(2) == [0.0, 0.5, 1.0, 1.5, 2.0]


def _label_boxes(figure: dict, plot_px: float) -> list[tuple[int, float, float]]:
    """(row, left, right) in x units of each band label, widths as band_label_rows assumes."""
    from frontend.figures import CHAR_PX, LABEL_ROW_PX

    rects = [s for s in figure["layout"]["shapes"] if s["type"] == "rect"]
    lo, hi = min(s["x0"] for s in rects), max(s["x1"] for s in rects)
    per_px = (hi - lo or 1.0) / plot_px
    return [(round(a["yshift"] / LABEL_ROW_PX), a["x"], a["x"] + (len(a["text"]) * CHAR_PX + 8) * per_px)
            for a in figure["layout"]["annotations"]]


@given(st.lists(st.integers(1, 60), max_size=12), st.integers(0, 200), st.sampled_from([250, 600, 1300]))
def test_band_labels_never_overlap_and_the_first_rows_fill_first(gaps: list[int], extra: int, plot_px: int) -> None:
    from frontend.figures import LABEL_ROWS, band_label_rows, band_shapes

    steps, at = [], 0
    for gap in gaps:
        at += gap
        steps.append(at)
    transitions = [_t(i + 1, f"dp={i + 1}", f"tp={i + 2},dp=1", "committed", s) for i, s in enumerate(steps)]
    bands = history_bands("dp=1", transitions, at + extra)
    shapes, notes = band_shapes(bands, plot_px)
    boxes = _label_boxes({"layout": {"shapes": shapes, "annotations": notes}}, plot_px)
    for i, (row, left, right) in enumerate(boxes):  # brute force: every pair in the same row
        assert 0 <= row < LABEL_ROWS
        for row2, left2, right2 in boxes[i + 1:]:
            assert row != row2 or right <= left2 or right2 <= left
    rows = band_label_rows(bands, plot_px)
    assert rows[0] == 0  # the first layout is always named
    # A label left out had no room in any row: each row's last label still covers its x0.
    for i, row in enumerate(rows):
        if row is None:
            for r in range(LABEL_ROWS):
                last = max((b for b, rr in zip(boxes, [x for x in rows if x is not None]) if b[0] == r
                            and b[1] < bands[i]["x0"]), default=None, key=lambda b: b[1])
                assert last is not None and last[2] > bands[i]["x0"]
    assert len([s for s in shapes if s["type"] == "line"]) == len(steps)  # a marker per switch


@given(st.floats(min_value=0, max_value=2.0**62))
def test_byte_ticks_are_binary_units_covering_the_top(top: float) -> None:
    from frontend.figure_style import byte_ticks

    values, texts = byte_ticks(top)
    assert values[0] == 0 and values[-1] >= top and 2 <= len(values) <= 12
    units = {t.split(" ")[1] for t in texts[1:]}
    assert len(units) == 1 and units <= {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
    assert all("e" not in t.split(" ")[0] for t in texts)


def test_no_figure_prints_an_exponent() -> None:
    """Hovers and ticks go through the formatter or d3's ~r (never exponents): big and tiny
    numbers in every job figure leave no "e+"/"e-" format and no number in e-notation."""
    import json
    import re

    plan = plan_preview(get_model("tiny-gpt"), "dp=2", "dp=4", gpus_per_node=2, staging_bytes=2**20)
    figures = [plan_heatmap_figure([[0, 3 * 2**40], [7, 0]]), round_bytes_figure([2**45, 12], [1e-7, 5880.0]),
               memory_wave_figure(plan["wave_after"], plan["wave_peak"], capacity_bytes=2**24),
               metric_figure("step_seconds", {"x": [1, 2], "y": [5.88e3, 1e-9]})]
    text = json.dumps(figures, ensure_ascii=False)
    strings = re.findall(r'"((?:[^"\\]|\\.)*)"', text)
    assert not [s for s in strings if re.search(r"\d(\.\d+)?e[+-]?\d", s, re.I) and not s.startswith("#")]
    assert not [s for s in strings if re.search(r"%\{[^}]*:[^}]*[eg]\}", s)]  # d3 e/g formats print exponents
