"""The one formatter (frontend/static/frontend/format.js) under node, against its Python
twin (frontend/formatting.py) on hypothesis-drawn numbers, and both against worked
examples: durations, binary bytes, counts, rates, percentages, relative times; never a
number in scientific notation. Skipped without node."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend import formatting as fmt

FORMAT = Path(__file__).resolve().parents[1] / "frontend" / "static" / "frontend" / "format.js"
NODE = shutil.which("node")
SCIENTIFIC = re.compile(r"\d(\.\d+)?e[+-]?\d", re.IGNORECASE)

RUNNER = """
import * as f from "%s";
let input = "";
process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => {
  const out = JSON.parse(input).map(([name, args]) => {
    if (name === "relativeTime") return f.relativeTime(args[0], args[1]);
    return f[name](...args);
  });
  process.stdout.write(JSON.stringify(out));
});
"""

# JS name -> the Python twin.
TWINS = {"sig": fmt.sig, "integer": fmt.integer, "duration": fmt.duration, "bytes": fmt.binary_bytes,
         "count": fmt.count, "rate": fmt.rate, "byteRate": fmt.byte_rate, "percent": fmt.percent,
         "relativeSeconds": fmt.relative_seconds, "hostStats": fmt.host_stats}


def run_js(calls: list[tuple[str, list]]) -> list[str]:
    runner = Path(__file__).parent / ".format_runner.mjs"
    runner.write_text(RUNNER % FORMAT.as_uri())
    try:
        done = subprocess.run([NODE, str(runner)], input=json.dumps(calls), capture_output=True, text=True, timeout=60)
    finally:
        runner.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


EXAMPLES = [
    ("duration", [5.88], "5.88 s"), ("duration", [19.5], "19.5 s"), ("duration", [0.00588], "5.88 ms"),
    ("duration", [0.9996], "1.00 s"), ("duration", [0.0000042], "4.20 µs"), ("duration", [59.9], "59.9 s"),
    ("duration", [59.96], "1 min 00 s"), ("duration", [185], "3 min 05 s"), ("duration", [7500], "2 h 05 min"),
    ("duration", [3 * 86400 + 4 * 3600], "3 d 04 h"), ("duration", [0], "0 s"), ("duration", [None], "–"),
    ("bytes", [512], "512 B"), ("bytes", [1536], "1.50 KiB"), ("bytes", [80 * 2**30], "80.0 GiB"),
    ("bytes", [2**20 - 1], "1.00 MiB"), ("bytes", [1023 * 2**20], "1023 MiB"), ("bytes", [3 * 2**40], "3.00 TiB"),
    ("count", [588], "588"), ("count", [12345], "12.3 k"), ("count", [999_999], "1.00 M"), ("count", [0.5], "0.500"),
    ("rate", [12345, "tokens"], "12.3 k tokens/s"), ("rate", [2.345, "steps"], "2.35 steps/s"),
    ("byteRate", [1.5 * 2**30], "1.50 GiB/s"), ("percent", [0.4534], "45.3 %"), ("percent", [0.000012], "0.00120 %"),
    ("integer", [1234567], "1,234,567"), ("integer", [-1234.5], "-1,235"), ("sig", [0.000588], "0.000588"),
    ("sig", [1.23e25], "12300000000000000000000000"),
    ("relativeSeconds", [3], "just now"), ("relativeSeconds", [42], "42 s ago"), ("relativeSeconds", [200], "3 min ago"),
    ("relativeSeconds", [5 * 3600 + 1], "5 h ago"), ("relativeSeconds", [-200], "in 3 min"),
    ("relativeSeconds", [2 * 86400], "2 d ago"),
    ("hostStats", [45.34, 16, 3 * 2**30, 16 * 2**30], "CPU 45.3 % of 16 · mem 3.00 GiB / 16.0 GiB"),
    ("hostStats", [None, None, None, None], ""),
    ("hostStats", [0.0, 2, 512, 2**20], "CPU 0 % of 2 · mem 512 B / 1.00 MiB"),
]

pytestmark_node = pytest.mark.skipif(NODE is None, reason="node is not installed")


@pytest.mark.parametrize("name,args,expected", EXAMPLES)
def test_python_twin_worked_examples(name: str, args: list, expected: str) -> None:
    assert TWINS[name](*args) == expected


@pytestmark_node
def test_js_worked_examples() -> None:
    got = run_js([(name, args) for name, args, _ in EXAMPLES])
    assert got == [expected for _, _, expected in EXAMPLES]


finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e30, max_value=1e30)
seconds = st.floats(min_value=0, max_value=1e12, allow_nan=False) | st.floats(min_value=0, max_value=1e-3)
near_units = st.sampled_from([0.9995, 0.99949999, 59.95, 999.5, 1023.5, 1024, 3599.5, 86399.9]).flatmap(
    lambda base: st.sampled_from([1, 1e-3, 1e-6, 2**10, 2**20, 2**30, 1e3, 1e6]).map(lambda k: base * k))


@pytestmark_node
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(finite | near_units, min_size=1, max_size=40), st.lists(seconds | near_units, min_size=1, max_size=40))
def test_js_and_python_print_the_same_text(numbers: list[float], durations: list[float]) -> None:
    calls = [(name, [x]) for x in numbers for name in ("sig", "integer", "bytes", "count", "percent", "byteRate")]
    calls += [("duration", [s]) for s in durations] + [("rate", [s, "steps"]) for s in durations]
    calls += [("relativeSeconds", [x]) for x in numbers if abs(x) < 1e12]  # (30,000 years)
    calls += [("hostStats", [abs(x) % 100, 8, abs(x), abs(x) * 2]) for x in numbers]
    got = run_js(calls)
    for (name, args), text in zip(calls, got):
        assert text == TWINS[name](*args), (name, args)
        assert not SCIENTIFIC.search(text), (name, args, text)


@given(finite)
def test_three_significant_digits_and_the_value_kept(x: float) -> None:
    text = fmt.sig(x)
    assert not SCIENTIFIC.search(text)
    if abs(x) >= 1e-15:  # (below: "0")
        assert abs(float(text) - x) <= abs(x) * 5e-3  # rounding to 3 digits moves it by at most half a unit
        assert len(text.lstrip("-").replace(".", "").lstrip("0")) >= 3 or abs(x) >= 1e21


@given(st.floats(min_value=1024, max_value=2**70, allow_nan=False))
def test_bytes_use_one_binary_unit_between_1_and_1024(n: float) -> None:
    value, unit = fmt.binary_bytes(n).split(" ")
    assert unit in {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}
    assert 1 <= float(value) < 1024 or unit == "EiB"
    scale = dict((u, d) for d, u in fmt.BINARY)[unit]
    assert abs(float(value) * scale - n) <= n * 5e-3


@pytestmark_node
def test_relative_time_of_iso_stamps_with_microseconds() -> None:
    now = 1_767_225_600_000  # 2026-01-01T00:00:00Z in ms
    got = run_js([("relativeTime", ["2025-12-31T23:57:00.123456+00:00", now]),
                  ("relativeTime", ["2025-12-31T23:59:58Z", now]), ("relativeTime", ["not a time", now]),
                  ("relativeTime", [None, now])])
    assert got == ["2 min ago", "just now", "–", "–"]
