"""The compare page's store (frontend/static/frontend/compare-store.js) against its Python
originals, under node: apply_emulation_event, and the query string that the page writes
and frontend/compare_views.py reads back. Skipped without node."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from django.http import QueryDict

from controlplane.emulation.events import EmulationEvent, EmulationSnapshot, EmulationView, apply_emulation_event
from frontend.compare_views import parse_runs, parse_settings

STORE = Path(__file__).resolve().parents[1] / "frontend" / "static" / "frontend" / "compare-store.js"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

RUNNER = """
import { applyEmulationEvent, comparisonQuery, emulationRequest } from "%s";
let input = "";
process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => {
  const out = JSON.parse(input).map((c) => {
    let snapshot = c.snapshot;
    const gaps = [];
    for (const e of c.events) { const r = applyEmulationEvent(snapshot, e); gaps.push(r.gap); snapshot = r.snapshot; }
    return { snapshot, gaps, query: comparisonQuery(c.settings, c.layouts, c.ids),
             request: emulationRequest(c.settings, c.layouts) };
  });
  process.stdout.write(JSON.stringify(out));
});
"""


def _view(rng: random.Random, run_id: int) -> EmulationView:
    state = rng.choice(["queued", "running", "done", "failed"])
    return EmulationView(id=run_id, model="tiny-gpt", layout=f"dp={run_id}", gpus=run_id, gpu_type="h100",
                         global_batch=8, micro_batch=1, seq_len=64, recompute="none", state=state,
                         message=rng.choice(["", "tracing"]), error="boom" if state == "failed" else "",
                         result={"step_seconds": rng.random()} if state == "done" else None,
                         wall_seconds=rng.random() if state in ("done", "failed") else None)


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    ids = tuple(rng.sample(range(1, 8), rng.randint(0, 4)))
    start = rng.randint(0, 5)
    snapshot = EmulationSnapshot(seq=start, ids=ids, runs=tuple(_view(rng, i) for i in ids if rng.random() < 0.7))
    events, seq = [], start
    for _ in range(rng.randint(0, 25)):
        seq += rng.choice([1, 1, 1, 1, 0, -1])  # mostly in order; some repeats
        events.append(EmulationEvent(seq=max(seq, 1), run=_view(rng, rng.randint(1, 8))))
    settings = {"model": rng.choice(["tiny-gpt", "llama3-8b"]), "gpu": rng.choice(["h100", "a100"]),
                "gpus": rng.randint(1, 64), "batch": rng.randint(1, 512), "micro": rng.randint(1, 8),
                "seq": rng.randint(1, 8192), "recompute": rng.choice(["none", "full"])}
    layouts = [rng.choice(["tp=2,dp=2", "pp=2,dp=2,zero=1", "encoder:tp=1,dp=4;llm:tp=2,dp=2"]) for _ in range(3)]
    return {"snapshot": snapshot, "events": events, "settings": settings, "layouts": layouts, "ids": list(ids)}


def test_js_store_matches_python() -> None:
    cases = [_case(seed) for seed in range(60)]
    wire = [{"snapshot": c["snapshot"].model_dump(mode="json"), "events": [e.model_dump(mode="json") for e in c["events"]],
             "settings": c["settings"], "layouts": c["layouts"], "ids": c["ids"]} for c in cases]
    proc = subprocess.run([NODE, "--input-type=module", "-e", RUNNER % STORE.as_uri()], input=json.dumps(wire),
                          capture_output=True, text=True, timeout=60, check=True)
    for case, got in zip(cases, json.loads(proc.stdout)):
        snapshot, gaps = case["snapshot"], []
        for event in case["events"]:
            gap = event.seq > snapshot.seq + 1
            gaps.append(gap)
            if gap:
                break  # the page reloads here; the rest of the case is not comparable
            snapshot = apply_emulation_event(snapshot, event)
        assert got["gaps"][:len(gaps)] == gaps
        if not any(gaps):
            assert EmulationSnapshot.model_validate(got["snapshot"]) == snapshot
        # The URL the page writes reopens the same settings, layouts and runs.
        query = QueryDict(got["query"])
        settings, problems = parse_settings(query)
        assert problems == []
        assert settings == {**case["settings"], "layouts": case["layouts"]}
        assert parse_runs(query.get("runs", "")) == case["ids"]
        configs = got["request"]["configs"]
        assert [c["layout"] for c in configs] == case["layouts"]
        assert {(c["gpus"], c["gpu_type"], c["global_batch"], c["micro_batch"], c["seq_len"]) for c in configs} <= {
            (case["settings"]["gpus"], case["settings"]["gpu"], case["settings"]["batch"], case["settings"]["micro"],
             case["settings"]["seq"])}


def test_js_search_top_keeps_what_the_emulator_search_keeps() -> None:
    from parallelism.emulator.search import top_fitting

    rng = random.Random(7)
    runs = []
    for run_id in range(1, 13):
        state = rng.choice(["done", "done", "done", "failed", "running"])
        result = ({"tokens_per_second": rng.choice([100.0, 250.0, 900.0, 40.0]) + run_id,
                   "memory": {"fits": rng.random() < 0.7}} if state == "done" else None)
        runs.append({"id": run_id, "layout": f"dp={run_id}", "state": state, "result": result})
    runner = (f'import {{ searchTop }} from "{STORE.as_uri()}";'
              'const runs = JSON.parse(process.argv[1]);'
              'process.stdout.write(JSON.stringify([1, 2, 3, 12].map((k) => searchTop(runs, k).map((r) => r.id))));')
    proc = subprocess.run([NODE, "--input-type=module", "-e", runner, json.dumps(runs)], capture_output=True,
                          text=True, timeout=60, check=True)
    done = [dict(r["result"], id=r["id"]) for r in runs if r["state"] == "done"]
    expected = [[r["id"] for r in top_fitting(done, k)] for k in (1, 2, 3, 12)]
    assert json.loads(proc.stdout) == expected and len(expected[-1]) >= 3  # some fit, some were left out
    assert len(expected[-1]) < len(done)


def test_js_search_request_and_status() -> None:
    """The search request the page posts is what POST /api/emulations/search takes, and a
    search run's states read as the page shows them (the layouts once done, the error once
    failed)."""
    from controlplane.emulation.api import SearchRequestSerializer

    settings = {"model": "tiny-gpt", "gpu": "a100", "gpus": 2, "batch": 8, "micro": 2, "seq": 64, "recompute": "full"}
    base = {"id": 5, "kind": "search", "top": 2, "message": "", "error": "", "result": None}
    runs = [{**base, "state": "queued"}, {**base, "state": "running", "message": "ranking the layouts"},
            {**base, "state": "done",
             "result": {"top": 2, "candidates": 9, "layouts": ["dp=2", "tp=2"], "dropped": []}},
            {**base, "state": "failed", "error": "no layout of tiny-gpt runs on 2 GPUs"}]
    runner = (f'import {{ searchRequest, searchStatus }} from "{STORE.as_uri()}";'
              'const [settings, runs] = JSON.parse(process.argv[1]);'
              'process.stdout.write(JSON.stringify([searchRequest(settings, 2), runs.map(searchStatus)]));')
    proc = subprocess.run([NODE, "--input-type=module", "-e", runner, json.dumps([settings, runs])],
                          capture_output=True, text=True, timeout=60, check=True)
    request, statuses = json.loads(proc.stdout)
    incoming = SearchRequestSerializer(data=request)
    assert incoming.is_valid(), incoming.errors
    assert dict(incoming.validated_data) == {"model": "tiny-gpt", "gpus": 2, "gpu_type": "a100", "global_batch": 8,
                                             "micro_batch": 2, "seq_len": 64, "recompute": "full", "top": 2}
    assert statuses == [
        {"text": "Search: waiting for an agent to rank the candidate layouts…", "layouts": None, "error": None},
        {"text": "Search: ranking the layouts…", "layouts": None, "error": None},
        {"text": "Search: emulating 2 of 9 candidate layouts on the agents; the 2 fastest that fit will stay…",
         "layouts": ["dp=2", "tp=2"], "error": None},
        {"text": "Search failed: no layout of tiny-gpt runs on 2 GPUs", "layouts": None,
         "error": "no layout of tiny-gpt runs on 2 GPUs"}]
