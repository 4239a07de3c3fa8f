"""`dynaplane plan` and `dynaplane models` as a user runs them (docs/contracts.md section 3)."""
from __future__ import annotations

import json
import subprocess
import sys

from parallelism.layout.catalog import get_model
from parallelism.planner.plan import PlanOptions, plan_routes
from tests.parallelism.planner.plan_oracle import simulate

CONTRACT_FIELDS = {"world_src", "world_dst", "state_bytes_dst", "local_bytes", "network_bytes", "min_network_bytes",
                   "transfers", "rounds", "max_rank_send_bytes", "max_rank_recv_bytes", "peak_staging_bytes",
                   "plan_seconds", "estimated_seconds"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynaplane", *args], capture_output=True, text=True, timeout=120)


def test_plan_json_has_the_contract_fields() -> None:
    out = _run("plan", "--model", "llama3-8b", "--from", "tp=8,pp=2,dp=2,zero=1", "--to", "tp=4,pp=2,dp=3,zero=1",
               "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert CONTRACT_FIELDS <= set(summary)
    assert (summary["world_src"], summary["world_dst"]) == (32, 24)
    assert 0 < summary["min_network_bytes"] <= summary["network_bytes"] <= summary["contract_order_network_bytes"]
    assert summary["network_bytes"] == summary["state_bytes_dst"] - summary["local_bytes"] - summary["derived_bytes"]
    assert summary["peak_staging_bytes"] <= 256 * 2**20
    assert len(summary["fingerprint"]) == 64


def test_plan_dump_is_a_correct_plan(tmp_path) -> None:
    dump = tmp_path / "plan.json"
    out = _run("plan", "--model", "tiny-gpt", "--from", "tp=2,pp=2,zero=1", "--to", "tp=4,dp=3,zero=3",
               "--staging-mb", "0.01", "--dump", str(dump), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(dump.read_text())
    assert set(data) == {"tensors", "src", "dst", "transfers", "local", "derived"}
    assert data["src"]["world"] == 4 and data["dst"]["world"] == 12
    t = data["transfers"][0]
    assert set(t) == {"round", "src", "dst", "tensor", "state", "offsets", "lengths"}
    assert {d["from_state"] for d in data["derived"]} <= {"master"}
    summary = json.loads(out.stdout)
    assert summary["rounds"] == 1 + max(t["round"] for t in data["transfers"]) > 1
    # The same plan in-process passes the oracle, and the dump is that plan.
    plan = plan_routes(get_model("tiny-gpt"), "tp=2,pp=2,zero=1", "tp=4,dp=3,zero=3",
                       PlanOptions(staging_bytes=int(0.01 * 2**20)))
    simulate(plan)
    assert plan.fingerprint == summary["fingerprint"]


def test_bad_layouts_are_named() -> None:
    out = _run("plan", "--model", "llama3-8b", "--from", "tp=3", "--to", "tp=2")
    assert out.returncode == 2
    assert "tp=3 does not divide 32 attention heads" in out.stderr
    out = _run("plan", "--model", "no-such-model", "--from", "tp=1", "--to", "tp=2")
    assert out.returncode == 2 and "unknown model 'no-such-model'" in out.stderr
    out = _run("plan", "--model", "qwen3-235b-a22b", "--from", "tp=4,dp=6,ep=3", "--to", "tp=4,dp=4,ep=4")
    assert out.returncode == 2 and "ep=3 does not divide 128 experts" in out.stderr


def test_heterogeneous_multimodal_plan() -> None:
    out = _run("plan", "--model", "tiny-vlm", "--from", "tp=2,dp=2",
               "--to", "encoder:dp=2,ranks=0-1;llm:tp=2,pp=2,ranks=2-5", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["world_dst"] == 6


def test_models_lists_the_catalog() -> None:
    out = _run("models", "--json")
    assert out.returncode == 0
    names = {m["name"]: m for m in json.loads(out.stdout)}
    assert {"tiny-gpt", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b", "qwen3-235b-a22b"} <= set(names)
    assert abs(names["llama3-8b"]["params"] - 8.03e9) / 8.03e9 < 0.005
