"""The elastic scheduler benchmark (benchmarks/elastic_scheduler.py) on small traces: its
accounting against hand-computed days, and a seeded synthetic day through all three modes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from parallelism.layout.elastic_inputs import SizeOption
from benchmarks.elastic_scheduler import MODES, replay
from benchmarks.elastic_trace import HOUR, Arrival, Template, day_trace


def arrival(at, name, *, gpus, elastic=False, lo=None, hi=None, priority=0, hours=1.0, state=0) -> Arrival:
    template = Template(name, "tiny-gpt", f"dp={gpus}", 1.0, 64, 16, elastic, priority, gpus, lo or gpus, hi or gpus)
    options = tuple(SizeOption(g, f"dp={g}", gpus / g, 1, state) for g in range(lo or gpus, (hi or gpus) + 1))
    return Arrival(at, name, template, steps=int(hours * HOUR), options=options)


def test_one_rigid_job_for_an_hour_of_a_two_hour_day_is_half_the_gpus() -> None:
    result = replay([arrival(0.0, "a", gpus=8)], nodes=1, per_node=8, hours=2.0, mode="online")
    assert result["utilisation"] == pytest.approx(0.5)
    assert result["allocated"] == pytest.approx(0.5)
    assert (result["finished"], result["resizes"]) == (1, 0)


def test_a_priority_job_borrows_from_an_elastic_one_which_grows_back_paying_its_pause() -> None:
    """An elastic job on 8 of 8 GPUs (min 4); a priority job needs 4 for an hour from 1 h.
    Static: the priority job waits for the elastic one's whole 3 h. Online: the elastic job
    shrinks at 1 h, grows back when the GPUs come free; each resize pauses it 0.22 s plus
    1 GB / 1.2 GB/s when it grows."""
    trace = [arrival(0.0, "train", gpus=8, elastic=True, lo=4, hi=8, hours=3.0, state=10**9),
             arrival(HOUR, "eval", gpus=4, priority=10)]
    static = replay(trace, nodes=1, per_node=8, hours=6.0, mode="static")
    assert static["priority_wait_mean_s"] == pytest.approx(2 * HOUR)
    online = replay(trace, nodes=1, per_node=8, hours=6.0, mode="online")
    assert online["priority_wait_mean_s"] == 0.0
    assert online["resizes"] == 2
    assert online["paused_gpu_hours"] * HOUR == pytest.approx(4 * 0.22 + 8 * (0.22 + 1 / 1.2), rel=1e-6)
    # train needs 3 h x 8 GPUs of work; the eval's hour on 4 costs it half a GPU-hour rate: it ends 1 h later
    assert online["finished"] == static["finished"] == 2
    total = 8 * 6 * HOUR
    assert online["utilisation"] * total == pytest.approx((3 * 8 + 4) * HOUR, rel=1e-6)
    assert online["allocated"] - online["utilisation"] == pytest.approx(online["paused_gpu_hours"] * HOUR / total)


def test_a_seeded_day_replays_the_same_and_the_modes_account_for_every_gpu_second() -> None:
    """16 nodes x 8 GPUs for 4 hours (seed 3: a priority job arrives while the cluster is full)."""
    first = day_trace(3, nodes=16, per_node=8, hours=4.0)
    assert first == day_trace(3, nodes=16, per_node=8, hours=4.0)
    assert first != day_trace(4, nodes=16, per_node=8, hours=4.0)
    assert {a.template.kind for a in first} >= {"pretrain-70b", "pretrain-8b", "priority"}
    results = {m: replay(first, nodes=16, per_node=8, hours=4.0, mode=m) for m in MODES}
    assert results["static"]["resizes"] == 0
    for result in results.values():
        assert 0 <= result["utilisation"] <= result["allocated"] <= 1 + 1e-9
        gap = (result["allocated"] - result["utilisation"]) * 16 * 8 * 4.0
        assert gap == pytest.approx(result["paused_gpu_hours"], abs=1e-6)
    online, restart, static = results["online"], results["restart"], results["static"]
    assert online["resizes"] > 0 and restart["resizes"] > 0
    assert online["paused_gpu_hours"] < restart["paused_gpu_hours"]
    assert online["utilisation"] > restart["utilisation"]
    assert online["priority_wait_mean_s"] < static["priority_wait_mean_s"]  # it borrows from elastic jobs


def test_the_command_prints_json() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.elastic_scheduler", "--nodes", "4", "--hours", "1",
                          "--json"], capture_output=True, text=True, check=True, timeout=300).stdout
    body = json.loads(out)
    assert [r["mode"] for r in body["results"]] == list(MODES)
    assert set(body["ratios"]) == {"online_vs_static", "online_vs_restart"}
