"""`dynaplane train`: local ranks, a growing switch, progress lines and the JSON log."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynaplane", "train", "--model", "tiny-gpt", "--seq", "16", *args],
                          capture_output=True, text=True, timeout=200)


def test_train_grows_the_world_at_a_switch_and_reports_it() -> None:
    out = _train("--layout", "tp=1,dp=1,zero=1", "--steps", "3", "--switch", "1:tp=2,dp=1,zero=1", "--json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "training tiny-gpt on 2 local ranks: tp=1,dp=1,zero=1, then tp=2,dp=1,zero=1 at step 1"
    assert sum(line.startswith("step ") for line in lines) == 3
    switch_line = next(line for line in lines if line.startswith("switch before step 2: zero=1 -> tp=2,zero=1"))
    assert "verified bit-exact" in switch_line
    log = json.loads(out.stdout[out.stdout.index("{"):])
    assert [s["step"] for s in log["steps"]] == [1, 2, 3]
    (switch,) = log["switches"]
    assert switch["verified"] and switch["network_bytes"] > 0 and switch["peak_bytes"] > 0


@pytest.mark.parametrize("args,message", [
    (["--layout", "tp=3", "--steps", "2"], "tp=3 does not divide 4 attention heads"),
    (["--layout", "tp=2", "--steps", "2", "--switch", "2:tp=1"], "switch steps must increase and lie in 1..1"),
    (["--layout", "tp=2", "--steps", "2", "--switch", "tp=1"], "expected STEP:LAYOUT"),
    (["--layout", "tp=2", "--world", "1", "--steps", "2"], "--world 1 is smaller than the 2 ranks"),
])
def test_train_refuses_bad_input_with_the_reason(args, message) -> None:
    out = _train(*args)
    assert out.returncode == 2
    assert message in out.stderr
