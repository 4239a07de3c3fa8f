"""The heartbeat's host stats (agents/node/host_stats.py): /proc parsing against worked
examples and an oracle, the sampler over real files, and the protocol's bounds."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from agents import protocol
from agents.node.config import AgentConfig
from agents.node.heartbeat import build_heartbeat
from agents.node.host_stats import HostSampler, cpu_percent, cpu_times, memory
from agents.node.inventory import virtual_gpus

STAT = "cpu  {0} {1} {2} {3} {4} {5} {6} {7} 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\nintr 5\n"
MEMINFO = "MemTotal:       {0} kB\nMemFree:         100 kB\nMemAvailable:   {1} kB\nBuffers:          10 kB\n"

counters = st.lists(st.integers(0, 10**9), min_size=8, max_size=8)


@given(before=counters, added=counters)
def test_cpu_percent_is_the_busy_share_of_the_elapsed_jiffies(before, added) -> None:
    after = [b + a for b, a in zip(before, added)]
    got = cpu_percent(cpu_times(STAT.format(*before)), cpu_times(STAT.format(*after)))
    elapsed = sum(added)
    idle = added[3] + added[4]  # idle + iowait
    expected = 0.0 if elapsed == 0 else 100 * (elapsed - idle) / elapsed
    assert got == pytest.approx(expected) and 0 <= got <= 100


def test_memory_is_total_minus_available_and_older_kernels_count_caches_free() -> None:
    assert memory(MEMINFO.format(1000, 400)) == (600 * 1024, 1000 * 1024)
    old = "MemTotal: 1000 kB\nMemFree: 300 kB\nBuffers: 100 kB\nCached: 200 kB\n"
    assert memory(old) == (400 * 1024, 1000 * 1024)
    with pytest.raises(ValueError, match="MemTotal"):
        memory("MemFree: 1 kB\n")


def test_the_sampler_reports_the_change_since_its_last_sample(tmp_path) -> None:
    (tmp_path / "meminfo").write_text(MEMINFO.format(2048, 1024))
    (tmp_path / "stat").write_text(STAT.format(50, 0, 50, 100, 0, 0, 0, 0))
    sampler = HostSampler(tmp_path)
    first = sampler.sample()
    assert first.cpu_percent == 50.0  # since boot
    assert (first.memory_used_bytes, first.memory_total_bytes) == (1024 * 1024, 2048 * 1024)
    (tmp_path / "stat").write_text(STAT.format(140, 0, 50, 110, 0, 0, 0, 0))  # 90 busy of 100 since
    assert sampler.sample().cpu_percent == 90.0
    assert HostSampler(tmp_path / "absent").sample() is None  # no /proc: no stats, the heartbeat goes on


def test_this_hosts_stats_validate() -> None:
    stats = HostSampler().sample()
    assert stats is not None and 0 < stats.memory_used_bytes <= stats.memory_total_bytes and stats.cpu_count >= 1


@pytest.mark.parametrize("field, value, rule", [
    ("cpu_percent", 100.5, "less than or equal to 100"), ("cpu_percent", -1, "greater than or equal to 0"),
    ("cpu_percent", float("nan"), "finite number"), ("memory_used_bytes", 9 * 2**30, "exceeds memory_total_bytes"),
    ("memory_total_bytes", 0, "greater than 0"), ("cpu_count", 0, "greater than 0"),
    ("memory_total_bytes", 2**63, "less than or equal to"),
])
def test_host_stats_refuse_what_no_host_reports(field, value, rule) -> None:
    good = {"cpu_percent": 12.5, "cpu_count": 8, "memory_used_bytes": 2**30, "memory_total_bytes": 8 * 2**30}
    with pytest.raises(ValidationError, match=rule) as caught:
        protocol.HostStats(**{**good, field: value})
    assert field in str(caught.value) or "memory_used_bytes" in str(caught.value)


def test_a_heartbeat_carries_its_host_stats_through_json() -> None:
    config = AgentConfig(name="node-1", gpus=1, device="cpu", broker_url="redis://x")
    stats = protocol.HostStats(cpu_percent=12.5, cpu_count=8, memory_used_bytes=2**30, memory_total_bytes=2**33)
    beat = build_heartbeat(config, virtual_gpus(1, memory_bytes=2**30), host_stats=stats)
    again = protocol.AgentHeartbeat.model_validate(beat.model_dump(mode="json"))
    assert again.host_stats == stats
    wire = beat.model_dump(mode="json")
    with pytest.raises(ValidationError, match="extra"):
        protocol.AgentHeartbeat.model_validate({**wire, "host_stats": {**wire["host_stats"], "swap": 1}})
    assert build_heartbeat(config, virtual_gpus(1, memory_bytes=2**30)).host_stats is None
