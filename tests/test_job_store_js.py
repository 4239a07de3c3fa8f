"""The job page's store (frontend/static/frontend/job-store.js) against its Python
originals, under node: snapshot + events == later snapshot (apply_job_event), the
history bands and the step time around a switch. Skipped without node."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from controlplane.common.events import HelloEvent
from controlplane.jobs.events import (ExportEvent, ExportView, JobLiveSnapshot, MetricsEvent, RewindEvent,
                                     TransitionEvent, TransitionView, apply_job_event)
from frontend.figures import history_bands, step_time_around

STORE = Path(__file__).resolve().parents[1] / "frontend" / "static" / "frontend" / "job-store.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

RUNNER = """
import { applyJobEvent, historyBands, stepTimeAround } from "%s";
let input = "";
process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => {
  const out = JSON.parse(input).map((c) => {
    let snapshot = c.snapshot;
    const gaps = [];
    for (const e of c.events) { const r = applyJobEvent(snapshot, e); gaps.push(r.gap); snapshot = r.snapshot; }
    const last = snapshot.metrics.loss && snapshot.metrics.loss.x.length ? snapshot.metrics.loss.x.at(-1) : 0;
    return { snapshot, gaps, bands: historyBands(c.layout, snapshot.transitions, last),
             around: snapshot.transitions.map((t) => stepTimeAround(snapshot.metrics.step_seconds, t.step)) };
  });
  process.stdout.write(JSON.stringify(out));
});
"""


def _transition(rng: random.Random, id_: int, step: int) -> TransitionView:
    state = rng.choice(["planned", "transferring", "committed", "aborted"])
    return TransitionView(
        id=id_, job=1, source_layout=f"dp={id_}", destination_layout=f"dp={id_ + 1}", source_world=id_,
        destination_world=id_ + 1, state=state, reason="r", plan_fingerprint="f", destination_placement=(),
        rendezvous="h:1", created_at="2026-01-01T00:00:00+00:00", started_at=None, finished_at=None,
        step=step if state == "committed" else None, prepare_seconds=None, pause_seconds=rng.random(),
        transfer_seconds=None, verify_seconds=None, network_bytes=None, rounds=None, peak_bytes=None,
        predicted_peak_bytes=None, verified=state == "committed" or None)


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    events, seq, step, ids = [], 0, 0, [1]
    for _ in range(rng.randint(0, 40)):
        seq += 1
        roll = rng.random()
        if roll < 0.7:
            step += 1
            events.append(MetricsEvent(seq=seq, job=1, step=step, loss=rng.choice([None, rng.random() * 8]),
                                       step_seconds=rng.random(), tokens_per_second=rng.choice([None, 1000.0]),
                                       validation_loss=rng.choice([None, None, rng.random() * 8])))
        elif roll < 0.75:  # an export of the job moved on: its own row; the snapshot only moves on
            events.append(ExportEvent(seq=seq, export=ExportView(
                id=1, job=1, job_name="j", checkpoint_step=step, state="running", path="j-step-1", files_written=0,
                files_total=2, bytes=0, seconds=None, error="", created_at="2026-01-01T00:00:00+00:00",
                started_at=None, finished_at=None)))
        elif roll < 0.8:  # a restore from a checkpoint: the record goes back, the steps train again
            step = rng.randint(0, step)
            events.append(RewindEvent(seq=seq, job=1, step=step))
        elif roll < 0.9:
            if rng.random() < 0.5:
                ids.append(ids[-1] + 1)
            events.append(TransitionEvent(seq=seq, transition=_transition(rng, ids[-1], step)))
        else:
            events.append(HelloEvent(seq=seq - 1))
            seq -= 1
    cut = rng.randint(0, len(events))
    snapshot = JobLiveSnapshot(seq=0, metrics={})
    for event in events[:cut]:
        snapshot = apply_job_event(snapshot, event)
    later = snapshot
    for event in events[cut:]:
        later = apply_job_event(later, event)
    replay = events[max(cut - rng.randint(0, 2), 0):]  # a page may receive events it already has
    return {"snapshot": snapshot.model_dump(mode="json"), "events": [e.model_dump(mode="json") for e in replay],
            "layout": "dp=1", "later": later.model_dump(mode="json")}


def test_js_store_matches_python_snapshot_bands_and_step_times(tmp_path: Path) -> None:
    cases = [_case(seed) for seed in range(150)]
    runner = tmp_path / "run.mjs"
    runner.write_text(RUNNER % STORE.as_uri())
    done = subprocess.run([NODE, str(runner)], input=json.dumps(cases), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    for case, result in zip(cases, results):
        later = case["later"]
        assert not any(result["gaps"])
        # JSON numbers: 3.0 from Python and 3 from JS compare equal.
        assert result["snapshot"] == json.loads(json.dumps(later)), case
        loss = later["metrics"].get("loss")
        last = loss["x"][-1] if loss and loss["x"] else 0  # (a rewind may empty a series)
        assert result["bands"] == history_bands(case["layout"], later["transitions"], last)
        assert [tuple(a) for a in result["around"]] == [
            step_time_around(later["metrics"].get("step_seconds"), t["step"]) for t in later["transitions"]]


def test_js_store_reports_a_gap_when_an_event_was_missed(tmp_path: Path) -> None:
    snapshot = JobLiveSnapshot(seq=3, metrics={}).model_dump(mode="json")
    event = MetricsEvent(seq=5, job=1, step=1, loss=1.0, step_seconds=None, tokens_per_second=None)
    runner = tmp_path / "gap.mjs"
    runner.write_text(f'import {{ applyJobEvent }} from "{STORE.as_uri()}";\n'
                      f"const r = applyJobEvent({json.dumps(snapshot)}, {json.dumps(event.model_dump(mode='json'))});\n"
                      "process.stdout.write(JSON.stringify(r));")
    done = subprocess.run([NODE, str(runner)], capture_output=True, text=True, timeout=30)
    result = json.loads(done.stdout)
    assert result["gap"] is True and result["snapshot"]["seq"] == 3


def test_js_rank_by_emulation_puts_fitting_fast_layouts_first(tmp_path: Path) -> None:
    proposals = [{"layout": name} for name in ("a", "b", "c", "d")]

    def done(step: float, peak: int) -> dict:
        return {"state": "done",
                "result": {"step_seconds": step, "tokens_per_second": 1 / step, "memory": {"peak_bytes": peak}}}

    runs = {"a": done(0.3, 10), "b": done(0.1, 99), "c": done(0.2, 10), "d": {"state": "running"}}
    runner = tmp_path / "rank.mjs"
    runner.write_text(f'import {{ rankByEmulation }} from "{STORE.as_uri()}";\n'
                      f"const r = rankByEmulation({json.dumps(proposals)}, {json.dumps(runs)}, 50);\n"
                      "process.stdout.write(JSON.stringify(r));")
    finished = subprocess.run([NODE, str(runner)], capture_output=True, text=True, timeout=30)
    ranked = json.loads(finished.stdout)
    assert [p["layout"] for p in ranked] == ["c", "a", "b", "d"]  # b is fastest but does not fit
    assert ranked[2]["emulated"]["fits"] is False and ranked[3]["emulated"] is None


CHARTS = STORE.with_name("metric-charts.js")


def _bands_case(rng: random.Random) -> dict:
    steps, at = [], 0
    for _ in range(rng.randint(0, 10)):
        at += rng.randint(1, 80)
        steps.append(at)
    transitions = [{"id": i + 1, "source_layout": "x", "destination_layout": rng.choice(["dp=4", "tp=2,pp=2,dp=2"]),
                    "state": "committed", "step": s, "pause_seconds": rng.choice([None, rng.random()])}
                   for i, s in enumerate(steps)]
    return {"bands": history_bands("dp=2", transitions, at + rng.randint(0, 100)),
            "plot_px": rng.choice([120, 300, 600, 1200]), "transitions": transitions}


def test_js_band_shapes_markers_and_label_rows_match_python(tmp_path: Path) -> None:
    from frontend.figures import band_shapes, top_margin

    cases = [_bands_case(random.Random(seed)) for seed in range(200)]
    runner = tmp_path / "bands.mjs"
    runner.write_text(f'import {{ bandShapes, topMargin }} from "{CHARTS.as_uri()}";\n'
                      "let input = '';\nprocess.stdin.on('data', (d) => { input += d; });\n"
                      "process.stdin.on('end', () => process.stdout.write(JSON.stringify(JSON.parse(input).map((c) => {"
                      " const [s, n] = bandShapes(c.bands, c.plot_px); return [s, n, topMargin(n)]; }))));")
    done = subprocess.run([NODE, str(runner)], input=json.dumps(cases), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for case, (shapes, notes, margin) in zip(cases, json.loads(done.stdout)):
        expected_shapes, expected_notes = band_shapes(case["bands"], case["plot_px"])
        assert json.loads(json.dumps([expected_shapes, expected_notes])) == [shapes, notes], case
        assert margin == top_margin(expected_notes)


def _smooth_oracle(ys: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased EMA, written out: sum of w^(i-j) (1-w) y_j over 1 - w^(i+1)."""
    if weight <= 0:
        return list(ys)
    return [sum(weight ** (i - j) * (1 - weight) * ys[j] for j in range(i + 1)) / (1 - weight ** (i + 1))
            for i in range(len(ys))]


def _elapsed_oracle(series: dict, transitions: list[dict], xs: list[float]) -> list[float]:
    points = list(zip(series["x"], series["y"]))
    return [sum(y for sx, y in points if sx <= x) + sum(t["pause_seconds"] or 0 for t in transitions
                                                         if t["state"] == "committed" and t["step"] < x) for x in xs]


def test_js_smoothing_and_the_time_axis_against_oracles(tmp_path: Path) -> None:
    rng = random.Random(7)
    cases = []
    for _ in range(60):
        n = rng.randint(0, 40)
        xs = sorted(rng.sample(range(1, 200), n))
        series = {"x": xs, "y": [rng.uniform(0.01, 3) for _ in xs]}
        case = _bands_case(rng)
        cases.append({"ys": series["y"], "weight": rng.choice([0, 0.3, 0.6, 0.9, 0.99]), "series": series,
                      "transitions": case["transitions"], "xs": xs[::2]})
    runner = tmp_path / "smooth.mjs"
    runner.write_text(f'import {{ smooth, elapsedSeconds }} from "{CHARTS.as_uri()}";\n'
                      "let input = '';\nprocess.stdin.on('data', (d) => { input += d; });\n"
                      "process.stdin.on('end', () => process.stdout.write(JSON.stringify(JSON.parse(input).map((c) =>"
                      " [smooth(c.ys, c.weight), elapsedSeconds(c.series, c.transitions, c.xs)]))));")
    done = subprocess.run([NODE, str(runner)], input=json.dumps(cases), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for case, (smoothed, elapsed) in zip(cases, json.loads(done.stdout)):
        assert smoothed == pytest.approx(_smooth_oracle(case["ys"], case["weight"]), rel=1e-9)
        assert elapsed == pytest.approx(_elapsed_oracle(case["series"], case["transitions"], case["xs"]), rel=1e-9)
        if case["ys"]:
            assert min(case["ys"]) - 1e-9 <= min(smoothed) and max(smoothed) <= max(case["ys"]) + 1e-9


def test_js_metric_figure_says_no_data_yet_then_draws_bands_with_the_data(tmp_path: Path) -> None:
    base = metric_figure_base()
    live = {"seq": 3, "metrics": {}, "transitions": []}
    grown = {"seq": 9, "metrics": {"step_seconds": {"x": [1, 2, 3, 4], "y": [.2, .2, .1, .1]},
                                   "loss": {"x": [1, 2, 3, 4, 5], "y": [4, 3, 2, 1, 1]}},
             "transitions": [{"id": 5, "source_layout": "dp=2", "destination_layout": "dp=4", "state": "committed",
                              "step": 2, "pause_seconds": 1.5}]}
    runner = tmp_path / "figure.mjs"
    runner.write_text(f'import {{ metricFigure }} from "{CHARTS.as_uri()}";\n'
                      f"const base = {json.dumps(base)};\n"
                      f"const out = [metricFigure(base, 'step_seconds', {json.dumps(live)}, 'dp=2'),"
                      f" metricFigure(base, 'step_seconds', {json.dumps(grown)}, 'dp=4'),"
                      f" metricFigure(base, 'step_seconds', {json.dumps(grown)}, 'dp=4', {{ smoothing: 0.5, axis: 'time' }})];\n"
                      "process.stdout.write(JSON.stringify(out));")
    done = subprocess.run([NODE, str(runner)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    empty, drawn, timed = json.loads(done.stdout)
    assert [a["text"] for a in empty["layout"]["annotations"]] == ["no data yet"]
    assert empty["layout"]["xaxis"]["visible"] is False and empty["layout"]["shapes"] == []
    # The band reaches the newest step of any metric (loss is at 5): it never lags the data.
    rects = [s for s in drawn["layout"]["shapes"] if s["type"] == "rect"]
    assert [(r["x0"], r["x1"]) for r in rects] == [(0, 2), (2, 5)] and drawn["bands"] == 2
    assert [a["text"] for a in drawn["layout"]["annotations"]] == ["dp=2", "#5 → dp=4"]
    assert drawn["layout"]["xaxis"]["visible"] is True
    # Time axis: step 3 ran after 0.2 + 0.2 s of steps and the 1.5 s pause, plus its own 0.1 s.
    assert timed["data"][0]["x"] == pytest.approx([0.2, 0.4, 2.0, 2.1])
    assert len(timed["data"]) == 2 and timed["data"][1]["name"] == "step_seconds (smoothed)"
    assert timed["layout"]["xaxis"]["title"]["text"] == "time since the first step (s)"


def metric_figure_base() -> dict:
    from frontend.figures import metric_figure

    return metric_figure("step_seconds", None)


def test_js_loss_chart_draws_the_validation_loss_as_one_trace_across_a_switch(tmp_path: Path) -> None:
    """The validation loss (at the job's eval_every steps) is the loss chart's second trace, one line
    through the switch at step 4, as the server draws it (figures.validation_trace); on the time axis
    its points move with the steps; smoothing leaves it as it is; the other charts do not draw it."""
    from frontend.figures import metric_figure, validation_trace

    validation = {"x": [2, 4, 6], "y": [3.5, 3.1, 2.9]}
    live = {"seq": 9, "transitions": [{"id": 5, "source_layout": "dp=2", "destination_layout": "dp=4",
                                       "state": "committed", "step": 4, "pause_seconds": 1.5}],
            "metrics": {"loss": {"x": [1, 2, 3, 4, 5, 6], "y": [4, 3.6, 3.4, 3.2, 3.0, 2.8]},
                        "step_seconds": {"x": [1, 2, 3, 4, 5, 6], "y": [.5, .5, .5, .5, .25, .25]},
                        "validation_loss": validation}}
    loss_base, step_base = metric_figure("loss", None), metric_figure("step_seconds", None)
    runner = tmp_path / "validation.mjs"
    runner.write_text(f'import {{ metricFigure }} from "{CHARTS.as_uri()}";\n'
                      f"const live = {json.dumps(live)};\n"
                      f"const out = [metricFigure({json.dumps(loss_base)}, 'loss', live, 'dp=4'),"
                      f" metricFigure({json.dumps(loss_base)}, 'loss', live, 'dp=4',"
                      f" {{ axis: 'time', smoothing: 0.6 }}),"
                      f" metricFigure({json.dumps(step_base)}, 'step_seconds', live, 'dp=4')];\n"
                      "process.stdout.write(JSON.stringify(out));")
    done = subprocess.run([NODE, str(runner)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    drawn, timed, steps = json.loads(done.stdout)
    assert len(drawn["data"]) == 2 and drawn["data"][1] == validation_trace(validation)
    assert drawn["data"][1]["name"] == "validation" and drawn["data"][1]["x"] == [2, 4, 6]  # one line through step 4
    assert drawn["layout"]["showlegend"] is True and drawn["layout"]["legend"]["yref"] == "container"
    # The server's figure of the same snapshot: the same second trace and legend.
    server = metric_figure("loss", live["metrics"]["loss"], (), validation=validation)
    assert server["data"][1] == drawn["data"][1] and server["layout"]["legend"] == drawn["layout"]["legend"]
    # Time axis: step 2 after 1 s, step 4 after 2 s, step 6 after 2 s + the 1.5 s pause + 0.5 s.
    assert [d["name"] for d in timed["data"]] == ["loss", "loss (smoothed)", "validation"]
    assert timed["data"][2]["x"] == pytest.approx([1.0, 2.0, 4.0]) and timed["data"][2]["y"] == validation["y"]
    assert timed["data"][2]["customdata"] == [2, 4, 6]
    assert len(steps["data"]) == 1 and not steps["layout"]["showlegend"]
    # No validation points (eval_every 0): one trace, no legend.
    assert len(metric_figure("loss", live["metrics"]["loss"], (), validation={"x": [], "y": []})["data"]) == 1


def test_js_export_text_and_upsert(tmp_path: Path) -> None:
    row = {"id": 3, "state": "running", "files_written": 1, "files_total": 4, "bytes": 3 * 2**20, "seconds": None,
           "error": ""}
    cases = [row, {**row, "files_total": None}, {**row, "state": "pending"},
             {**row, "state": "done", "files_written": 4, "seconds": 12.5},
             {**row, "state": "failed", "error": "j-1/step-00000002-0: not a DCP checkpoint (no .metadata)"}]
    runner = tmp_path / "exports.mjs"
    runner.write_text(f'import {{ exportText, upsertExport }} from "{STORE.as_uri()}";\n'
                      f"const cases = {json.dumps(cases)};\n"
                      "process.stdout.write(JSON.stringify([cases.map(exportText),"
                      " upsertExport([{id: 1}, {id: 3, state: 'pending'}], {id: 3, state: 'done'}),"
                      " upsertExport([{id: 1}], {id: 2})]));")
    done = subprocess.run([NODE, str(runner)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    texts, replaced, added = json.loads(done.stdout)
    assert texts == ["writing: 1 file of 4 written (3.00 MiB)", "reading the checkpoint",
                     "queued for the control worker", "done: 4 files, 3.00 MiB in 12.5 s",
                     "failed: j-1/step-00000002-0: not a DCP checkpoint (no .metadata)"]
    assert replaced == [{"id": 3, "state": "done"}, {"id": 1}] and [r["id"] for r in added] == [2, 1]
