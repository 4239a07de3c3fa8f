"""The cluster page's filter in the address (frontend/static/frontend/cluster-filter.js), under
node: a filter written to the query reads back as itself; what the page does not know (a state,
a job without a row) is left out; nothing set is no query. Skipped without node."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

STATIC = Path(__file__).resolve().parents[1] / "frontend" / "static" / "frontend"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")
STATES = ["healthy", "lost", "draining"]
JOBS = ["job-001", "llama 70b", "a&b=c?d", "ünï"]

SCRIPT = f'import {{ filterFromQuery, filterToQuery }} from "{(STATIC / "cluster-filter.js").as_uri()}";\n' + """
let input = ""; process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => {
  const { states, jobs, filters, queries } = JSON.parse(input);
  const known = new Set(jobs);
  process.stdout.write(JSON.stringify({
    written: filters.map((f) => filterToQuery(f)),
    roundTrip: filters.map((f) => filterFromQuery(filterToQuery(f), states, known)),
    read: queries.map((q) => filterFromQuery(q, states, known)),
  }));
});
"""


def _node(tmp_path: Path, payload: dict) -> dict:
    runner = tmp_path / "run.mjs"
    runner.write_text(SCRIPT)
    done = subprocess.run([NODE, str(runner)], input=json.dumps(payload), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_filter_in_the_address_reads_back_as_itself_and_unknowns_are_left_out(tmp_path: Path) -> None:
    rng = random.Random(7)
    names = ["", "node-00", "sim 01", "a&b", "x=y", "100%", "ünï"]
    filters = [{"state": "", "job": "", "name": ""}] + [
        {"state": rng.choice(["", *STATES]), "job": rng.choice(["", *JOBS]), "name": rng.choice(names)}
        for _ in range(200)]
    queries = ["", "?state=bogus&job=job-001", "?job=not-a-job&node=node-1", "?state=lost&node=" + "n" * 500,
               "state=healthy", "?node=&state="]
    got = _node(tmp_path, {"states": STATES, "jobs": JOBS, "filters": filters, "queries": queries})
    assert got["roundTrip"] == filters
    assert got["written"][0] == ""  # nothing set: no query
    assert all(written.startswith("?") for written in got["written"][1:] if written)
    assert all(written == "" for written, f in zip(got["written"], filters) if not any(f.values()))
    assert got["read"] == [
        {"state": "", "job": "", "name": ""},
        {"state": "", "job": "job-001", "name": ""},  # an unknown state: any
        {"state": "", "job": "", "name": "node-1"},  # a job the page does not have: any
        {"state": "lost", "job": "", "name": "n" * 100},  # (no name is that long)
        {"state": "healthy", "job": "", "name": ""},  # (URLSearchParams takes it without its "?")
        {"state": "", "job": "", "name": ""},
    ]
