"""Issue 11: a schema-driven fuzzer (schemathesis, the maintained OpenAPI fuzzer) against a
live stack, with a token, so writes are fuzzed too: no 5xx, no hang (every answer within
10 s), every status code and body as the schema says. The stack has no agents, so the jobs
the fuzzer creates never train (they stay pending or are refused for want of GPUs) and the
run costs the machine only the web process."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack import StackProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
MIN_REQUESTS = 1000


def test_a_fuzzer_finds_no_server_error_no_hang_and_no_schema_violation(tmp_path) -> None:
    stack = StackProcess(tmp_path / "stack", agents=0, gpus_per_agent=1, env={"DATABASE_URL": None, "REDIS_URL": None})
    stack.start()
    try:
        stack.wait_ready(timeout=120)
        argv = [str(Path(sys.executable).parent / "schemathesis"), "run", f"{stack.url}api/schema/",
                "--url", stack.url.rstrip("/"), "--header", f"Authorization: Token {stack.state['token']}",
                "--checks", CHECKS, "--phases", "examples,coverage,fuzzing", "--max-examples", "40",
                "--workers", "1", "--max-response-time", "10", "--seed", "11", "--no-color",
                "--report", "junit", "--report-dir", str(tmp_path / "report")]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=780)
        out = run.stdout + run.stderr
        (tmp_path / "schemathesis.out").write_text(out)
        assert run.returncode == 0, out[-6000:]
        requests = _test_cases(out)
        print(f"schemathesis: {requests} test cases, {_seconds(out)} s")
        assert requests >= MIN_REQUESTS, out[-3000:]
    finally:
        stack.stop()


def _test_cases(out: str) -> int:
    """The run's number of generated test cases (each one request, or more for stateful links)."""
    found = re.findall(r"(\d[\d,]*) (?:generated|test cases?)", out)
    return max((int(n.replace(",", "")) for n in found), default=0)


def _seconds(out: str) -> str:
    match = re.search(r"in ([\d.]+)s =+\s*$", out, re.MULTILINE)
    return match.group(1) if match else "?"
