"""The simulator half of parallelism/emulator stays pure: stdlib + numpy + itself, no torch."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "parallelism" / "emulator"
PURE = ["__init__", "errors", "trace", "devices", "network", "costs", "schedule", "stage_cost", "simulate", "metrics",
        "trace_edit", "attention_kernels", "grad_accumulation", "grad_sync", "pipeline_p2p", "hidden_dropout",
        "optimizer_step"]
ALLOWED = {"__future__", "dataclasses", "json", "math", "pathlib", "typing", "numpy", "parallelism.emulator"}


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports(module):
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    bad = [n for n in names if not any(n == ok or n.startswith(ok + ".") for ok in ALLOWED)]
    assert bad == [], f"{module}.py imports {bad}"
