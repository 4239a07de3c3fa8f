"""The import rules of ARCHITECTURE.md, checked on the source (AST, no imports run)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> top-level names (or dotted prefixes) it must not import
FORBIDDEN = {
    "agents/layout": ["torch", "django", "celery", "channels", "controlplane", "frontend", "agents.node",
                      "agents.engine", "agents.training", "agents.emulator", "agents.protocol"],
    "agents/protocol.py": ["torch", "django", "controlplane", "frontend"],
    "agents/node": ["django", "controlplane", "frontend", "torch", "channels", "rest_framework"],
    "agents/engine": ["django", "celery", "controlplane", "frontend", "channels"],
    "agents/training": ["django", "celery", "controlplane", "frontend", "channels"],
    # The rank processes: training (torch) plus reports through the broker (celery).
    "agents/runtime": ["django", "controlplane", "frontend", "channels", "rest_framework"],
    "agents/emulator": ["django", "celery", "controlplane", "frontend", "channels"],
    "controlplane": ["torch", "agents.engine", "agents.training", "agents.emulator", "agents.node"],
    "frontend": ["torch", "agents.engine", "agents.training", "agents.emulator", "agents.node"],
    "dynaplane": ["django", "controlplane", "frontend", "torch"],
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations(target: str, forbidden: list[str], root: Path = ROOT) -> list[str]:
    base = root / target
    files = [base] if base.is_file() else sorted(base.rglob("*.py"))
    bad = []
    for path in files:
        for line, name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(root)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("target", sorted(FORBIDDEN))
def test_import_boundaries(target: str) -> None:
    if not (ROOT / target).exists():
        pytest.skip(f"{target} does not exist yet")
    assert _violations(target, FORBIDDEN[target]) == []


def test_the_checker_catches_a_violation(tmp_path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("import os\nfrom django.db import models\n")
    assert _violations("pkg", ["django"], root=tmp_path) == ["pkg/m.py:2 imports django.db"]


def test_importing_agents_layout_does_not_import_torch_or_django() -> None:
    import subprocess
    import sys

    code = ("import sys, agents.layout.spec, agents.protocol; "
            "print(sorted(m for m in ('torch', 'django', 'celery') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
