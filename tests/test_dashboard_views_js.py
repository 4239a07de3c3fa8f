"""The pure parts of the jobs list's view (jobs-view.js), the proposals' one prediction
(job-store.js reconcile, against its Python original) and the log panel's line levels
(log-view.js), under node. Skipped without node."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from controlplane.jobs.proposals import reconcile
from frontend.jobs_query import SORT_COLUMNS, STATE_FILTERS

STATIC = Path(__file__).resolve().parents[1] / "frontend" / "static" / "frontend"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")
LIVE = ["restoring", "running", "starting", "stopping", "switching"]


def _node(tmp_path: Path, script: str, payload) -> object:
    runner = tmp_path / "run.mjs"
    runner.write_text(script)
    done = subprocess.run([NODE, str(runner)], input=json.dumps(payload), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


READ = """let input = ""; process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => { process.stdout.write(JSON.stringify(main(JSON.parse(input)))); });
"""


def _rows(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(rng.randint(0, 12)):
        rows.append({"id": i + 1, "name": f"job-{rng.randint(1, 30)}", "model": rng.choice(["tiny-gpt", "llama3-8b"]),
                     "layout": rng.choice(["dp=2", "tp=2,dp=2", "dp=10"]), "gpus": rng.randint(1, 8),
                     "state": rng.choice(STATE_FILTERS[1:]), "step": rng.choice([None, rng.randint(0, 500)]),
                     "loss": rng.choice([None, round(rng.uniform(0, 9), 3)]), "switches": rng.randint(0, 3),
                     # (policy on, most GPUs, fewest GPUs): elastic-view.js elasticSortKey
                     "elastic": rng.choice([None, [rng.randint(0, 1), rng.randint(1, 3), rng.randint(1, 3)]]),
                     "priority": rng.choice([None, rng.randint(-2, 2)]), "created": rng.randint(0, 10**6)})
    return rows


def _oracle(rows: list[dict], view: dict) -> list[int]:
    """The documented rule, in Python: filter, then by the column (missing last), then newest id."""
    words = view["q"].lower().split()
    kept = [r for r in rows
            if (view["state"] == "" or (r["state"] in LIVE if view["state"] == "active" else r["state"] == view["state"]))
            and all(w in f"{r['name']} {r['model']}".lower() for w in words)]

    def natural(text: str) -> list:
        import re
        return [(0, int(t), "") if t.isdigit() else (1, 0, t.lower()) for t in re.findall(r"\d+|\D+", text)]

    column, sign = view["sort"], 1 if view["dir"] == "asc" else -1
    present = [r for r in kept if r[column] is not None]
    missing = sorted((r for r in kept if r[column] is None), key=lambda r: -r["id"])
    present.sort(key=lambda r: -r["id"])
    present.sort(key=(lambda r: natural(str(r[column]))) if column in ("name", "model", "layout", "state")
                 else (lambda r: r[column]), reverse=sign < 0)
    return [r["id"] for r in present + missing]


def test_the_jobs_view_filters_and_sorts_as_the_rule_says(tmp_path: Path) -> None:
    rng = random.Random(28)
    cases = []
    for _ in range(300):
        view = {"sort": rng.choice(list(SORT_COLUMNS)), "dir": rng.choice(["asc", "desc"]),
                "state": rng.choice(["", *STATE_FILTERS]), "q": rng.choice(["", "llama", "JOB-1", "tiny job", "zzz"])}
        cases.append({"rows": _rows(rng), "view": view})
    script = (f'import {{ arrange }} from "{(STATIC / "jobs-view.js").as_uri()}";\n'
              f"const live = {json.dumps(LIVE)};\n"
              "function main(cases) { return cases.map((c) => arrange(c.rows, c.view, live).map((r) => r.id)); }\n"
              + READ)
    got = _node(tmp_path, script, cases)
    assert {c["view"]["sort"] for c in cases} >= {"elastic", "priority"}  # the columns issue 31 added sort too
    for case, ids in zip(cases, got):
        # Ties (equal values) are broken by the newest id in both; a stable sort makes them equal.
        assert ids == _oracle(case["rows"], case["view"]), case["view"]


def test_a_header_click_and_the_address(tmp_path: Path) -> None:
    script = (f'import {{ clickSort, toQuery, DEFAULT_VIEW }} from "{(STATIC / "jobs-view.js").as_uri()}";\n'
              "function main(first) {\n"
              "  const a = clickSort(DEFAULT_VIEW, 'name', first);\n"
              "  const b = clickSort(a, 'name', first);\n"
              "  const c = clickSort(b, 'step', first);\n"
              "  return [a, b, c, toQuery(DEFAULT_VIEW), toQuery({ ...c, state: 'active', q: 'a&b c' })];\n"
              "}\n" + READ)
    a, b, c, default, query = _node(tmp_path, script, SORT_COLUMNS)
    assert (a["sort"], a["dir"]) == ("name", "asc") and (b["sort"], b["dir"]) == ("name", "desc")
    assert (c["sort"], c["dir"]) == ("step", "desc")
    assert default == "" and query == "?sort=step&dir=desc&state=active&q=a%26b+c"


def test_the_js_prediction_is_the_python_one(tmp_path: Path) -> None:
    rng = random.Random(5)
    cases = []
    for _ in range(200):
        proposal = {"layout": "dp=4", "step_seconds": rng.choice([None, rng.uniform(0.001, 9)])}
        emulated = rng.choice([None, {"step_seconds": rng.uniform(0.0001, 2), "gpu_type": "h100"}])
        cases.append([proposal, emulated])
    script = (f'import {{ reconcile }} from "{(STATIC / "job-store.js").as_uri()}";\n'
              "function main(cases) { return cases.map(([p, e]) => reconcile(p, e)); }\n" + READ)
    got = _node(tmp_path, script, cases)
    for (proposal, emulated), js in zip(cases, got):
        assert js == reconcile(proposal, emulated)  # (IEEE division: the same to the bit)


def test_log_lines_are_marked_errors_and_warnings(tmp_path: Path) -> None:
    lines = ["rank 0: training dp=2 on 2 ranks, ready in 3.1 s",
             "[W1203 19:43:08.172793038 socket.cpp:764] [c10d] The IPv6 network addresses cannot be retrieved",
             "Traceback (most recent call last):", '  File "<src>/agents/runtime/worker.py", line 9, in main',
             "    raise RuntimeError('boom')", "RuntimeError: boom", "rank 0: 12 steps in 3.0 s",
             "UserWarning: TypedStorage is deprecated", "torch.distributed.DistBackendError: NCCL error"]
    script = (f'import {{ classifyLines }} from "{(STATIC / "log-view.js").as_uri()}";\n'
              "function main(lines) { return classifyLines(lines).map((l) => l.level); }\n" + READ)
    # (log-view.js imports format.js only: no DOM is touched at import)
    levels = _node(tmp_path, script, lines)
    assert levels == ["info", "warning", "error", "error", "error", "error", "info", "warning", "error"]
