"""Rank 0's log tail for the control plane (protocol.JobLogTail): the last lines of a log
file, read from its end (never the whole file), cut to the protocol's bounds, with the
agent's own folders written as placeholders, so that no path of the node's disk leaves it."""
from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Callable

from agents import protocol

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout the agent runs from


def redactions(run_root: Path) -> tuple[tuple[str, str], ...]:
    """(folder, placeholder) pairs, longest folder first (a folder inside another one is
    replaced before it): the rank processes' run folder, the source, Python, home."""
    pairs = {str(run_root): "<run>", str(SOURCE_ROOT): "<src>", sys.prefix: "<python>", sys.base_prefix: "<python>",
             os.path.realpath(sys.prefix): "<python>", os.path.expanduser("~"): "~"}
    return tuple(sorted(((k, v) for k, v in pairs.items() if len(k) > 1), key=lambda kv: -len(kv[0])))


def clean_line(line: str, replace: tuple[tuple[str, str], ...] = (),
               line_chars: int = protocol.LOG_LINE_CHARS) -> str:
    """One line as it may leave the node: folders replaced, control characters (escape
    sequences' ESC, NUL...) shown as U+FFFD, cut to `line_chars` with an ellipsis."""
    for folder, placeholder in replace:
        line = line.replace(folder, placeholder)
    line = "".join(ch if ch == "\t" or ch.isprintable() else "\ufffd" for ch in line)
    return line if len(line) <= line_chars else line[:line_chars - 1] + "…"


def read_tail(path: Path, *, replace: tuple[tuple[str, str], ...] = (), max_lines: int = protocol.LOG_TAIL_LINES,
              max_bytes: int = protocol.LOG_TAIL_BYTES,
              line_chars: int = protocol.LOG_LINE_CHARS) -> tuple[tuple[str, ...], bool]:
    """(the last lines, whether earlier ones were left out). Reads at most 4 x max_bytes
    from the end of the file; a line cut by that start is dropped."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - 4 * max_bytes)
        f.seek(start)
        data = f.read(size - start)
    lines = data.decode("utf-8", "replace").splitlines()
    truncated = start > 0
    if truncated and lines:
        lines = lines[1:]
    if len(lines) > max_lines:
        lines, truncated = lines[-max_lines:], True
    lines = [clean_line(line, replace, line_chars) for line in lines]
    while lines and sum(len(line.encode("utf-8", "surrogatepass")) for line in lines) > max_bytes:
        lines, truncated = lines[1:], True
    return tuple(lines), truncated


class LogShipper:
    """Sends a job's rank-0 log tail when its file changed (size or modification time), at
    most once every `min_seconds` per job, and once more, `finished`, when the rank exits."""

    def __init__(self, send: Callable[[protocol.JobLogTail], None], node: str, run_root: Path,
                 min_seconds: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._send, self._node, self._clock, self._min = send, node, clock, min_seconds
        self._replace = redactions(run_root)
        self._seen: dict[int, tuple[int, int]] = {}  # job id -> (size, mtime_ns) last sent
        self._sent_at: dict[int, float] = {}

    def poll(self, job_id: int, rank: int, path: Path, restore_id: int | None) -> bool:
        """Send the tail if the log changed since the last one sent (and not too soon)."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return False
        key = (stat.st_size, stat.st_mtime_ns)
        now = self._clock()
        if self._seen.get(job_id) == key or now - self._sent_at.get(job_id, -self._min) < self._min:
            return False
        self._ship(job_id, rank, path, restore_id, finished=False)
        self._seen[job_id], self._sent_at[job_id] = key, now
        return True

    def final(self, job_id: int, rank: int, path: Path, restore_id: int | None) -> None:
        """The rank has exited: its last lines, whatever was sent before; the job is forgotten."""
        self._seen.pop(job_id, None)
        self._sent_at.pop(job_id, None)
        self._ship(job_id, rank, path, restore_id, finished=True)

    def _ship(self, job_id: int, rank: int, path: Path, restore_id: int | None, *, finished: bool) -> None:
        try:
            lines, truncated = read_tail(path, replace=self._replace)
        except OSError:  # gone or unreadable between the stat and the read: the next change sends it
            return
        self._send(protocol.JobLogTail(
            job_id=job_id, node=self._node, rank=rank, restore_id=restore_id, lines=lines, truncated=truncated,
            finished=finished, sent_at=datetime.datetime.now(datetime.timezone.utc)))
