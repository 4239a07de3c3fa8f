"""A multimodal job (tiny-vlm) through the whole stack with heterogeneous layouts (issue 8):
POST /api/jobs starts the agents' rank processes on a colocated per-module layout across
both nodes, they train (HeteroTrainer) and checkpoint, and two online resizes move it to a
non-colocated layout (the encoder on its own rank) and then to a homogeneous one, each
switch verified tensor by tensor, training going on with every step reported once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallelism.layout.spec import parse_layout
from tests.support.stack import wait_for, wait_for_transition_end

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Encoder ZeRO-1 over 4 ranks: the class token's (1 row) chunk is empty on ranks 1-3.
# (in the control plane's canonical spelling, which is what the API returns)
COLOCATED = str(parse_layout("encoder:dp=4,zero=1;llm:tp=2,dp=2"))
NON_COLOCATED = str(parse_layout("encoder:dp=1,ranks=0-0;llm:dp=2,ranks=1-2"))
HOMOGENEOUS = str(parse_layout("dp=2"))


def test_a_multimodal_job_trains_checkpoints_and_resizes_between_heterogeneous_layouts(stack) -> None:
    job = stack.post("api/jobs", {"name": "vlm", "model": "tiny-vlm", "layout": COLOCATED, "global_batch": 8,
                                  "seq_len": 16, "checkpoint_interval": 2})
    assert (job["state"], job["layout"], job["world_size"]) == ("starting", COLOCATED, 4), job
    assert sorted({p["node"] for p in job["placement"]}) == ["node-1", "node-2"]

    def read() -> dict:
        return stack.get(f"api/jobs/{job['id']}", token=True)

    def loss() -> dict:
        return stack.get(f"api/jobs/{job['id']}/live", token=True)["metrics"].get("loss", {"x": [], "y": []})

    try:
        wait_for(lambda: read()["state"] == "running", timeout=120)
        first, _ = wait_for(lambda: (j := read())["checkpoint_step"] is not None and len(loss()["x"]) >= 3 and j,
                            timeout=120)
        meta = json.loads((Path(first["checkpoint_path"]) / "complete.json").read_text())
        assert (meta["model"], meta["layout"]) == ("tiny-vlm", COLOCATED)
        assert meta["step"] == first["checkpoint_step"] and meta["step"] % 2 == 0
        losses = loss()["y"]
        assert all(5 < v < 8 for v in losses[:3]), losses  # about ln(vocab 512) = 6.2 at the start

        for layout, world in ((NON_COLOCATED, 3), (HOMOGENEOUS, 2)):
            transition = stack.post(f"api/jobs/{job['id']}/resize", {"layout": layout})
            assert transition["destination_layout"] == layout, transition
            done, seconds = wait_for_transition_end(stack, transition['id'])
            assert done["state"] == "committed", done
            assert done["verification"]["verified"] is True and done["verification"]["matches_plan"] is True
            checks = done["verification"]["tensors"]
            assert checks and all(c["match"] for c in checks)
            assert {c["name"].split(".")[0] for c in checks} == {"encoder", "llm"}  # both modules verified
            assert done["network_bytes"] > 0  # each module's state moved to its new ranks
            wait_for(lambda: (j := read())["state"] == "running" and j["layout"] == layout
                     and j["world_size"] == world, timeout=60)
            seen = max(loss()["x"])
            wait_for(lambda: max(loss()["x"]) >= seen + 2, timeout=60)  # trains on the new layout
            print(f"resize to {layout}: committed {seconds:.1f} s after POST, pause {done['pause_seconds']:.3f} s")

        after = read()
        assert len(after["gpus"]) == 2 and stack.get("api/health")["gpus"]["free"] == 2
        # A checkpoint of the last layout (the trainer rebuilt on its meshes after the shrinks).
        wait_for(lambda: json.loads((Path(read()["checkpoint_path"]) / "complete.json").read_text())["layout"]
                 == HOMOGENEOUS, timeout=60)
        series, _ = wait_for(lambda: len((m := loss())["x"]) >= 30 and m, timeout=90)
        steps, values = series["x"], series["y"]
        # Every step once, across both switches (sorted: the control worker's threads may apply
        # two step reports sent milliseconds apart out of order).
        assert sorted(steps) == list(range(1, len(steps) + 1)), steps
        by_step = dict(zip(steps, values))
        start, end = by_step[1], by_step[max(steps)]
        assert end < start - 0.3, by_step  # it learns
        print(f"loss {start:.3f} -> {end:.3f} over {len(steps)} steps on three layouts")
        stack.post(f"api/jobs/{job['id']}/stop", {})
        wait_for(lambda: read()["state"] == "stopped", timeout=60)
        assert stack.get("api/health")["gpus"]["free"] == 4
    finally:
        if read()["state"] in ("starting", "running", "switching", "restoring"):
            stack.post(f"api/jobs/{job['id']}/stop", {})
        wait_for(lambda: read()["state"] in ("stopped", "failed"), timeout=60)
