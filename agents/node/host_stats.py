"""The host's CPU utilisation and memory for the heartbeat (protocol.HostStats), read from
/proc (Linux; psutil is not among the dependencies). CPU utilisation is the change of
/proc/stat's counters between two samples: the first sample covers the time since boot."""
from __future__ import annotations

import os
from pathlib import Path

from agents import protocol


def cpu_times(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat's `cpu` line. Idle is idle +
    iowait; total is user..steal (guest time is already inside user and nice).

    >>> cpu_times("cpu  10 0 5 80 5 0 0 0 0 0\\ncpu0 1 0 0 0 0 0 0 0 0 0")
    (15, 100)
    """
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:9]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            total = sum(values)
            return total - idle, total
    raise ValueError("no aggregate `cpu` line in /proc/stat")


def cpu_percent(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Busy share of the time between two cpu_times samples, 0-100 (0 when no time passed)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return 0.0
    return min(max(100.0 * busy / total, 0.0), 100.0)


def memory(meminfo_text: str) -> tuple[int, int]:
    """(used, total) bytes from /proc/meminfo: used is MemTotal - MemAvailable (what the
    kernel could not hand out without swapping; older kernels: free + buffers + cached)."""
    kib = {}
    for line in meminfo_text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            kib[name] = int(parts[0])
    if "MemTotal" not in kib:
        raise ValueError("no MemTotal in /proc/meminfo")
    total = kib["MemTotal"] * 1024
    available = kib.get("MemAvailable", kib.get("MemFree", 0) + kib.get("Buffers", 0) + kib.get("Cached", 0)) * 1024
    return min(max(total - available, 0), total), total


class HostSampler:
    """One sample per heartbeat; keeps the previous CPU counters for the next delta."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._previous = (0, 0)

    def sample(self) -> protocol.HostStats | None:
        """The host's stats now, or None where /proc cannot be read (not Linux)."""
        try:
            now = cpu_times((self._proc / "stat").read_text())
            used, total = memory((self._proc / "meminfo").read_text())
        except (OSError, ValueError):
            return None
        percent = cpu_percent(self._previous, now)
        self._previous = now
        return protocol.HostStats(cpu_percent=round(percent, 2), cpu_count=os.cpu_count() or 1,
                                  memory_used_bytes=used, memory_total_bytes=total)
