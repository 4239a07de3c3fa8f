"""Rank 0's log tail (agents/node/log_tail.py and protocol.JobLogTail): the last lines of a
real file against a whole-file oracle, every bound of the protocol, no path of the node's
disk in what leaves it, and a shipper that sends on change and once more at the end."""
from __future__ import annotations

import sys
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from agents import protocol
from agents.node.log_tail import SOURCE_ROOT, LogShipper, clean_line, read_tail, redactions


def _oracle(text: str, n: int) -> list[str]:
    return text.splitlines()[-n:]


def test_a_long_log_gives_its_last_lines_exactly(tmp_path) -> None:
    path = tmp_path / "rank-0.log"
    text = "".join(f"step {i}: loss {i / 7:.4f}\n" for i in range(20_000))
    path.write_text(text)
    lines, truncated = read_tail(path)
    assert list(lines) == _oracle(text, protocol.LOG_TAIL_LINES) and truncated
    short = tmp_path / "short.log"
    short.write_text("one\ntwo\n")
    assert read_tail(short) == (("one", "two"), False)
    (tmp_path / "empty.log").write_text("")
    assert read_tail(tmp_path / "empty.log") == ((), False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.text(min_size=0, max_size=900), min_size=0, max_size=120))
def test_any_log_gives_a_tail_the_protocol_accepts(chunks, tmp_path) -> None:
    path = tmp_path / "any.log"
    path.write_bytes("\n".join(chunks).encode("utf-8", "surrogatepass"))
    lines, truncated = read_tail(path, replace=redactions(tmp_path))
    tail = protocol.JobLogTail(job_id=1, node="node-1", rank=0, lines=lines, truncated=truncated,
                               sent_at=datetime.now(timezone.utc))
    assert len(tail.lines) <= protocol.LOG_TAIL_LINES
    assert all(len(line) <= protocol.LOG_LINE_CHARS for line in tail.lines)
    assert sum(len(line.encode("utf-8", "surrogatepass")) for line in tail.lines) <= protocol.LOG_TAIL_BYTES
    if not truncated:  # nothing left out: every line of the file is there, in order
        assert len(lines) == len(path.read_bytes().decode("utf-8", "replace").splitlines())


def test_lines_are_cut_and_wide_characters_bound_the_bytes(tmp_path) -> None:
    path = tmp_path / "wide.log"
    path.write_text(("€" * 1000 + "\n") * 60)  # 3 bytes a character
    lines, truncated = read_tail(path)
    assert truncated and all(len(line) == protocol.LOG_LINE_CHARS and line.endswith("…") for line in lines)
    assert len(lines) == protocol.LOG_TAIL_BYTES // len(lines[0].encode()) and len(lines) < protocol.LOG_TAIL_LINES


def test_no_folder_of_the_node_leaves_it(tmp_path) -> None:
    run_root = tmp_path / "var" / "agents" / "node-1" / "jobs"
    source = f'  File "{SOURCE_ROOT}/agents/runtime/worker.py", line 9, in main'
    python = f'  File "{sys.prefix}/lib/python3.12/site-packages/torch/distributed/c10d.py", line 3'
    run = f"checkpoint written to {run_root}/job-3/ckpt"
    replace = redactions(run_root)
    cleaned = [clean_line(line, replace) for line in (source, python, run)]
    assert cleaned == ['  File "<src>/agents/runtime/worker.py", line 9, in main',
                       '  File "<python>/lib/python3.12/site-packages/torch/distributed/c10d.py", line 3',
                       "checkpoint written to <run>/job-3/ckpt"]
    assert clean_line("\x1b[31mred\x1b[0m\x00") == "\ufffd[31mred\ufffd[0m\ufffd"  # no escape sequence gets through


def test_the_shipper_sends_on_change_at_most_once_a_second_and_once_more_at_the_end(tmp_path) -> None:
    sent: list[protocol.JobLogTail] = []
    now = [100.0]
    shipper = LogShipper(sent.append, "node-1", tmp_path, min_seconds=1.0, clock=lambda: now[0])
    path = tmp_path / "job-4" / "rank-0.log"
    assert shipper.poll(4, 0, path, None) is False  # no log yet
    path.parent.mkdir()
    path.write_text("rank 0: training dp=2 on 2 ranks\n")
    assert shipper.poll(4, 0, path, None) is True
    assert shipper.poll(4, 0, path, None) is False  # unchanged
    with path.open("a") as f:
        f.write("a warning\n")
    now[0] += 0.5
    assert shipper.poll(4, 0, path, None) is False  # changed, but too soon
    now[0] += 0.6
    assert shipper.poll(4, 0, path, None) is True
    with path.open("a") as f:
        f.write(f"Traceback (most recent call last):\n  File \"{tmp_path}/x.py\"\nRuntimeError: boom\n")
    shipper.final(4, 0, path, 2)  # the rank exited: its last lines at once, whatever the clock says
    assert [t.lines[-1] for t in sent] == ["rank 0: training dp=2 on 2 ranks", "a warning", "RuntimeError: boom"]
    assert [t.finished for t in sent] == [False, False, True] and sent[-1].restore_id == 2
    assert str(tmp_path) not in "\n".join(sent[-1].lines) and '"<run>/x.py"' in sent[-1].lines[-2]
    assert shipper.poll(4, 0, path, None) is True  # (forgotten at the end: a restart ships anew)


@pytest.mark.parametrize("field, value, rule", [
    ("lines", ["x"] * (protocol.LOG_TAIL_LINES + 1), "at most 50 items"),
    ("lines", ["x" * (protocol.LOG_LINE_CHARS + 1)], "at most 400 characters"),
    ("lines", ["two\nlines"], "line break"),
    ("lines", ["€" * 400] * 14, "more than LOG_TAIL_BYTES"),
    ("node", "../etc", "DNS label"),
    ("job_id", 0, "greater than 0"),
    ("rank", -1, "greater than or equal to 0"),
])
def test_a_log_tail_outside_the_bounds_is_refused_naming_the_field(field, value, rule) -> None:
    good = {"job_id": 1, "node": "node-1", "rank": 0, "lines": ["ok"], "truncated": False,
            "sent_at": datetime.now(timezone.utc).isoformat()}
    with pytest.raises(ValidationError, match=rule) as caught:
        protocol.JobLogTail.model_validate({**good, field: value})
    assert field in str(caught.value)
    with pytest.raises(ValidationError, match="extra"):
        protocol.JobLogTail.model_validate({**good, "path": "/var/run"})
