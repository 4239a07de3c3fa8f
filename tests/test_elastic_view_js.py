"""The elastic scheduler's words on the pages (elastic-view.js), under node: the range text
agrees with its Python twin (frontend/elastic_text.py, which the jobs list renders), and a
pending change reads with its reason and its predicted gain in the one formatter's units.
Skipped without node."""
from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from frontend.elastic_text import range_text
from frontend.formatting import duration

STATIC = Path(__file__).resolve().parents[1] / "frontend" / "static" / "frontend"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")
READ = """let input = ""; process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => { process.stdout.write(JSON.stringify(main(JSON.parse(input)))); });
"""


def _node(tmp_path: Path, body: str, payload) -> object:
    runner = tmp_path / "run.mjs"
    runner.write_text(f'import * as view from "{(STATIC / "elastic-view.js").as_uri()}";\n{body}\n{READ}')
    done = subprocess.run([NODE, str(runner)], input=json.dumps(payload), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_range_text_matches_the_python_twin(tmp_path) -> None:
    cases = [{"min_gpus": lo, "max_gpus": hi, "world_size": world}
             for lo, hi, world in itertools.product([None, 1, 2, 8], [None, 1, 4, 16], [1, 2, 4])]
    got = _node(tmp_path, "const main = (cases) => cases.map(view.rangeText);", cases)
    assert got == [range_text(c["min_gpus"], c["max_gpus"], c["world_size"]) for c in cases]
    assert "2 GPUs (follows the current size)" in got
    scheduler = [{"min_gpus": 1, "max_gpus": 4, "elastic": True, "queued": False},
                 {"min_gpus": 2, "max_gpus": 2, "elastic": False, "queued": False},
                 {"min_gpus": 4, "max_gpus": 4, "elastic": False, "queued": True}]
    assert _node(tmp_path, "const main = (jobs) => jobs.map(view.schedulerRangeText);", scheduler) == [
        "1–4 GPUs", "2 GPUs (its size: policy off)", "4 GPUs"]


def test_the_elastic_column_sorts_by_policy_then_the_range(tmp_path) -> None:
    jobs = [{"elastic": True, "min_gpus": 1, "max_gpus": None, "world_size": 4},
            {"elastic": False, "min_gpus": None, "max_gpus": None, "world_size": 8},
            {"elastic": True, "min_gpus": 2, "max_gpus": 8, "world_size": 2}]
    got = _node(tmp_path, "const main = (jobs) => jobs.map(view.elasticSortKey);", jobs)
    assert got == [[1, 4, 1], [0, 8, 8], [1, 8, 2]]


SETTINGS = {"grow_horizon_seconds": 3600.0, "min_interval_seconds": 300.0}


def _plan(**extra) -> dict:
    return {"enabled": True, "problem": None, "settings": SETTINGS, "jobs": [], "decisions": [], "waiting": [],
            **extra}


def test_a_pending_change_reads_with_its_reason_and_gain(tmp_path) -> None:
    grow = {"job_id": 1, "job": "a", "kind": "grow", "gpus_from": 2, "gpus_to": 4, "layout": "dp=4",
            "reason": "grew to 4 (dp=4): 2 GPUs free", "step_seconds": 0.0512, "pause_seconds": 1.25,
            "gain_seconds": 1834.2}
    shrink = {**grow, "job_id": 2, "job": "b", "kind": "shrink", "gpus_from": 4, "gpus_to": 2, "layout": "dp=2",
              "reason": "shrank to 2 (dp=2): job 'eval' (priority 10) needed 4 GPUs", "gain_seconds": 0.0,
              "step_seconds": None}
    start = {**grow, "job_id": 3, "job": "c", "kind": "start", "gpus_from": 0, "gpus_to": 1, "layout": "dp=1",
             "reason": "started on 1 (dp=1)"}
    plan = _plan(decisions=[grow, shrink, start], waiting=[{"job_id": 4, "job": "d", "reason": "needs 8 GPUs"}],
                 jobs=[{"id": 5, "elastic": False, "queued": False, "busy": False, "frozen": None, "backoff_until": None},
                       {"id": 6, "elastic": True, "queued": False, "busy": False, "backoff_until": None,
                        "frozen": "resized 40 s ago; not again within 300 s"},
                       {"id": 7, "elastic": True, "queued": False, "busy": False, "frozen": None,
                        "backoff_until": None}])
    script = """const main = (plan) => ({
      rows: plan.decisions.map((d) => [view.changeText(d), view.gainText(d, plan.settings), view.pauseText(d),
                                       view.stepText(d)]),
      pending: [1, 2, 3, 4, 5, 6, 7, 8].map((id) => view.pendingText(plan, id)),
      off: view.pendingText({ ...plan, enabled: false, decisions: [], waiting: [] }, 7),
    });"""
    got = _node(tmp_path, script, plan)
    assert got["rows"] == [
        ["grow 2 → 4 GPUs", f"saves {duration(1834.2)} of training within {duration(3600)}", duration(1.25),
         duration(0.0512)],
        ["shrink 4 → 2 GPUs", "none for this job: frees 2 GPUs", duration(1.25), "not predicted (no measured step yet)"],
        ["start on 1 GPU", "starts the queued job", "–", duration(0.0512)],
    ]
    assert got["rows"][0][1] == "saves 30 min 34 s of training within 1 h 00 min"
    assert got["pending"][0] == ("grow 2 → 4 GPUs (dp=4). Reason: grew to 4 (dp=4): 2 GPUs free. Predicted gain: "
                                 "saves 30 min 34 s of training within 1 h 00 min; pause 1.25 s.")
    assert got["pending"][1].startswith("shrink 4 → 2 GPUs (dp=2). Reason: shrank to 2 (dp=2): job 'eval'")
    assert got["pending"][2].endswith("Predicted gain: starts the queued job.")
    assert got["pending"][3] == "queued, not started yet: needs 8 GPUs"
    assert got["pending"][4] == "none (policy off: never resized)"
    assert got["pending"][5] == "none (resized 40 s ago; not again within 300 s)"
    assert got["pending"][6] == "none: the scheduler would change nothing now"
    assert got["pending"][7] == "none: the scheduler sees live jobs and queued ones only"  # e.g. pending, not queued
    assert got["off"].startswith("none: the elastic scheduler is off")
    assert not any("e+" in text or "e-" in text for row in got["rows"] for text in row)
