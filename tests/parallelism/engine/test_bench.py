"""`dynaplane bench switch`: engine and DCP checkpoint baseline agree bit for bit."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parallelism.engine.bench import bench_rank, summarize
from parallelism.engine.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONTRACT_KEYS = {"model", "world", "src", "dst", "switch_seconds", "checkpoint_seconds", "speedup", "network_bytes",
                 "achieved_gbps", "p2p_gbps", "peak_bytes_measured", "peak_bytes_predicted", "bitexact"}


@pytest.mark.parametrize(("src", "dst"), [("tp=2,dp=2,zero=1", "dp=4,zero=3"), ("dp=2", "tp=2,pp=2,zero=1")])
def test_engine_matches_the_dcp_checkpoint_path(src: str, dst: str) -> None:
    ranks = run_ranks(4, bench_rank, "tiny-gpt", src, dst, 1.0, timeout_s=120)
    assert all(r["same_as_checkpoint"] for r in ranks), "engine shards differ from what DCP loads"
    assert all(r["digests_match"] for r in ranks)
    result = summarize("tiny-gpt", 4, src, dst, ranks)
    assert CONTRACT_KEYS <= set(result)
    assert result["bitexact"] is True
    assert all(m <= p for m, p in zip(result["peak_bytes_measured"], result["peak_bytes_predicted"]))
    assert result["p2p_gbps"] > 0 and result["switch_seconds"] > 0


def test_replicated_kv_heads_match_the_dcp_checkpoint_path() -> None:
    """tp=4 over tiny-gpt's 2 kv heads: each head on 2 TP ranks. DCP saves and loads them as
    DTensors on a (head, copy, data) mesh; the engine's shards equal what it loads."""
    ranks = run_ranks(4, bench_rank, "tiny-gpt", "dp=4,zero=1", "tp=4,zero=1", 1.0, timeout_s=120)
    assert all(r["same_as_checkpoint"] and r["digests_match"] for r in ranks)
    assert summarize("tiny-gpt", 4, "dp=4,zero=1", "tp=4,zero=1", ranks)["bitexact"] is True


def test_command_prints_the_contract_json() -> None:
    out = subprocess.run([sys.executable, "-m", "dynaplane", "bench", "switch", "--model", "tiny-gpt", "--world", "2",
                          "--from", "dp=2", "--to", "tp=2,zero=1", "--json"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert CONTRACT_KEYS <= set(json.loads(out.stdout))
