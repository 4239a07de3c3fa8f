"""The cluster page's model (cluster-model.js) and GPU map geometry (gpu-map.js), under node:
built from the compact snapshot (frontend/cluster_compact.py), then fed random event streams,
it ends where the Python rule (controlplane/cluster/events.py apply_event) ends, its counts
agree with a recount, and it says which GPU cell changed. Skipped without node."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from controlplane.cluster.events import ClusterSnapshot, GpuEvent, GpuView, JobEvent, JobView, NodeEvent, NodeView, \
    apply_event
from controlplane.common.events import HelloEvent
from frontend.cluster_compact import compact_gpus, expand_gpus

STATIC = Path(__file__).resolve().parents[1] / "frontend" / "static" / "frontend"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")
GPU_STATES = ("free", "allocated", "draining", "lost")


def _run(tmp_path: Path, script: str, payload) -> object:
    runner = tmp_path / "run.mjs"
    runner.write_text(script + """
let input = ""; process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => { process.stdout.write(JSON.stringify(main(JSON.parse(input)))); });
""")
    done = subprocess.run([NODE, str(runner)], input=json.dumps(payload), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _node(name: str, state: str = "healthy") -> NodeView:
    return NodeView(name=name, host=f"h-{name}", device="cpu", state=state, gpu_count=2, gpu_memory_bytes=2)


def _gpu(node: str, index: int, state: str = "free", job: str | None = None) -> GpuView:
    return GpuView(node=node, index=index, model_name="virtual", memory_bytes=1, state=state, job=job)


def _job(i: int, state: str = "running") -> JobView:
    return JobView(id=i, name=f"job-{i}", model="tiny-gpt", layout="dp=2", state=state, gpus=2)


def _page_snapshot(snapshot: ClusterSnapshot) -> dict:
    """What frontend/views.py embeds: GPUs compact."""
    rows = [(g.node, g.index, g.model_name, g.memory_bytes, g.state, g.job) for g in snapshot.gpus]
    return {"seq": snapshot.seq, "nodes": [n.model_dump(mode="json") for n in snapshot.nodes],
            "gpus": compact_gpus(rows), "jobs": [j.model_dump(mode="json") for j in snapshot.jobs]}


def test_the_compact_form_round_trips() -> None:
    rows = [("node-2", 1, "H100", 80, "allocated", "a"), ("node-1", 0, "H100", 80, "free", None),
            ("node-2", 0, "A100", 40, "lost", "a")]
    compact = compact_gpus(rows)
    assert compact["tables"]["node"] == ["node-2", "node-1"] and compact["tables"]["job"] == ["a"]
    assert compact["rows"][1] == [1, 0, 0, 0, 1, -1]
    assert [tuple(g.values()) for g in expand_gpus(compact)] == rows


def _stream(rng: random.Random, nodes: int, seq: int) -> list[dict]:
    """Events as the server sends them, with the odd stale one and hello."""
    events = []
    for _ in range(rng.randint(1, 40)):
        kind = rng.choice(["gpu", "gpu", "gpu", "node", "job", "stale", "hello"])
        if kind == "stale":
            events.append(GpuEvent(seq=rng.randint(0, seq), gpu=_gpu("node-1", 0, "lost")).model_dump(mode="json"))
            continue
        if kind == "hello":
            events.append(HelloEvent(seq=rng.randint(0, seq)).model_dump(mode="json"))
            continue
        seq += 1
        n = rng.randint(1, nodes + 1)  # node nodes+1: one that joins
        if kind == "gpu":
            state = rng.choice(GPU_STATES)
            job = f"job-{rng.randint(1, 3)}" if state in ("allocated", "draining") else None
            gpu = _gpu(f"node-{n}", rng.randint(0, 2), state, job)
            events.append(GpuEvent(seq=seq, gpu=gpu).model_dump(mode="json"))
        elif kind == "node":
            events.append(NodeEvent(seq=seq, node=_node(f"node-{n}", rng.choice(["healthy", "lost"])))
                          .model_dump(mode="json"))
        else:
            op = rng.choice(["upsert", "upsert", "remove"])
            events.append(JobEvent(op=op, seq=seq, job=_job(rng.randint(1, 4), rng.choice(["running", "stopped"])))
                          .model_dump(mode="json"))
    return events


MODEL = """import { ClusterModel, filterNodes } from "%s";
function main(cases) {
  return cases.map(({ snapshot, events }) => {
    const model = new ClusterModel(snapshot);
    const changes = [];
    for (const e of events) {
      const { verdict, change } = model.apply(e);
      const cell = change && change.slot !== undefined ? model.slots[change.slot] : null;
      changes.push([verdict, cell ? [change.slot, `${cell.node}/${cell.index}`, `${e.gpu.node}/${e.gpu.index}`,
        cell.state === e.gpu.state] : change && change.relayout ? "relayout" : null]);
    }
    const recount = { node: {}, gpu: {}, job: {} };
    for (const n of model.nodes.values()) recount.node[n.state] = (recount.node[n.state] || 0) + 1;
    for (const g of model.gpus.values()) recount.gpu[g.state] = (recount.gpu[g.state] || 0) + 1;
    for (const j of model.jobs.values()) recount.job[j.state] = (recount.job[j.state] || 0) + 1;
    const clean = (c) => Object.fromEntries(Object.entries(c).filter(([, v]) => v));
    const held = Object.fromEntries([...model.jobGpus].map(([job, keys]) => [job, [...keys].sort()]));
    const order = model.slots.map((g) => `${g.node}/${g.index}`);
    return { plain: model.plain(), changes, counts: ["node", "gpu", "job"].map((k) => clean(model.count[k])),
             recount: ["node", "gpu", "job"].map((k) => recount[k]), held, order,
             lost: filterNodes(model, { state: "lost" }), groups: filterNodes(model, {}).map((g) => g.state) };
  });
}""" % (STATIC / "cluster-model.js").as_uri()


def test_the_model_follows_events_as_the_python_rule_does(tmp_path) -> None:
    rng = random.Random(47)
    cases, expected = [], []
    for _ in range(60):
        nodes = rng.randint(1, 4)
        snapshot = ClusterSnapshot(
            seq=10, nodes=tuple(_node(f"node-{n}") for n in range(1, nodes + 1)),
            gpus=tuple(_gpu(f"node-{n}", i) for n in range(1, nodes + 1) for i in range(2)), jobs=(_job(1), _job(2)))
        events = _stream(rng, nodes, 10)
        # The Python rule, with the page's seq rule (a gap stops it: the page reloads there).
        python, gap_at = snapshot, None
        for k, e in enumerate(events):
            if e["type"] != "hello" and e["seq"] > python.seq + 1 or e["type"] == "hello" and e["seq"] > python.seq:
                gap_at = k
                break
            parsed = {"gpu": GpuEvent, "node": NodeEvent, "job": JobEvent, "hello": HelloEvent}[e["type"]](**e)
            python = apply_event(python, parsed)
        cases.append({"snapshot": _page_snapshot(snapshot), "events": events[:gap_at]})
        expected.append(python)
    for got, python in zip(_run(tmp_path, MODEL, cases), expected):
        assert ClusterSnapshot(**got["plain"]).canonical() == python.canonical()
        assert got["plain"]["seq"] == python.seq
        assert got["counts"] == got["recount"]
        for job, keys in got["held"].items():
            assert keys == sorted(g.key for g in python.gpus if g.job == job)
        # The drawing order: nodes by name (naturally), GPUs by index.
        assert got["order"] == [g.key for g in sorted(python.gpus, key=lambda g: (int(g.node[5:]), g.index))]
        lost = {n.name for n in python.nodes if n.state == "lost"}
        assert {n for group in got["lost"] for n in group["nodes"]} == lost
        assert got["groups"] == sorted(got["groups"], key=lambda s: s == "healthy")
        for verdict, change in got["changes"]:
            assert verdict in ("apply", "stale")
            if isinstance(change, list):  # the cell to redraw is the event's GPU, in its new state
                assert change[1] == change[2] and change[3] is True


def test_a_gap_and_a_newer_hello_ask_for_a_snapshot(tmp_path) -> None:
    snapshot = _page_snapshot(ClusterSnapshot(seq=5, nodes=(_node("node-1"),), gpus=(_gpu("node-1", 0),), jobs=()))
    events = [HelloEvent(seq=5).model_dump(), GpuEvent(seq=6, gpu=_gpu("node-1", 0, "lost")).model_dump(),
              GpuEvent(seq=6, gpu=_gpu("node-1", 0, "free")).model_dump(),
              GpuEvent(seq=8, gpu=_gpu("node-1", 0, "free")).model_dump(), HelloEvent(seq=9).model_dump()]
    got = _run(tmp_path, MODEL, [{"snapshot": snapshot, "events": events}])[0]
    assert [v for v, _ in got["changes"]] == ["stale", "apply", "stale", "gap", "gap"]
    assert got["changes"][1][1] == [0, "node-1/0", "node-1/0", True]
    assert got["plain"]["seq"] == 6 and got["plain"]["gpus"][0]["state"] == "lost"


GEOMETRY = """import { gridLayout, cellAt, hitCell } from "%s";
function main({ width, sizes, cell }) {
  const layout = gridLayout(width, sizes, { cell, gap: 3 });
  const back = [];
  sizes.forEach((n, node) => { for (let pos = 0; pos < n; pos++) {
    const { x, y } = cellAt(layout, node, pos);
    back.push([node, pos, x, y, hitCell(layout, sizes, x + cell / 2, y + cell / 2)]);
  } });
  return { layout, back, gap: hitCell(layout, sizes, layout.blockW + 1, 1),
    past: hitCell(layout, sizes, 1, layout.height + 50) };
}""" % (STATIC / "gpu-map.js").as_uri()


@pytest.mark.parametrize("width,sizes", [(350, [8] * 1024), (1300, [8] * 40 + [4, 16, 0, 8]), (30, [2, 2])])
def test_every_cell_is_inside_the_map_and_hits_back_to_itself(tmp_path, width, sizes) -> None:
    got = _run(tmp_path, GEOMETRY, {"width": width, "sizes": sizes, "cell": 8})
    layout = got["layout"]
    assert layout["width"] <= max(width, layout["blockW"])  # no wider than asked (one block at least)
    seen = set()
    for node, pos, x, y, hit in got["back"]:
        assert 0 <= x <= layout["width"] - 8 and 0 <= y <= layout["height"] - 8
        assert hit == {"node": node, "pos": pos}
        assert (x, y) not in seen
        seen.add((x, y))
    assert got["gap"] is None and got["past"] is None
