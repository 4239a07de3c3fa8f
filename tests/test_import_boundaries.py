"""The import rules (docs/architecture.md), checked on the source (AST, no imports run):
which packages may import which, the order of the jobs app's modules, no import of another
module's private `_names`, and no import loop between the project's files (function-level
imports included: they hide a loop, they do not remove it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> top-level names (or dotted prefixes) it must not import
# The parallelism library (parallelism/) is what the control plane and the node agents (agents/)
# build on: it imports neither of them, nor the command (dynaplane/).
LIBRARY = ["django", "celery", "channels", "rest_framework", "controlplane", "frontend", "dynaplane", "agents"]

FORBIDDEN = {
    "parallelism/layout": [*LIBRARY, "torch", "parallelism.planner", "parallelism.engine", "parallelism.training",
                           "parallelism.emulator"],
    # The planner sits on the layouts: pure as they are, and never the other way round.
    "parallelism/planner": [*LIBRARY, "torch", "parallelism.engine", "parallelism.training", "parallelism.emulator"],
    # The engine (switch driver included) sits below the trainer, the rank processes and the emulator.
    "parallelism/engine": [*LIBRARY, "parallelism.training", "parallelism.emulator"],
    "parallelism/training": [*LIBRARY, "parallelism.emulator"],
    "parallelism/emulator": LIBRARY,
    # Hugging Face weights in and out: on the layouts and the engine's shards, beside the trainer;
    # its name/shape maps and config rules are pure (no torch).
    "parallelism/hf_weights": [*LIBRARY, "parallelism.training", "parallelism.emulator", "parallelism.planner"],
    **{f"parallelism/hf_weights/{name}.py": ["torch", "safetensors", "parallelism.engine"]
       for name in ("pieces", "families", "config_rules", "config_out")},
    "agents/protocol.py": ["torch", "django", "controlplane", "frontend", "dynaplane", "parallelism"],
    "agents/processes.py": ["torch", "django", "celery", "controlplane", "frontend", "dynaplane", "agents.node",
                            "parallelism.engine", "parallelism.training", "parallelism.emulator", "agents.runtime"],
    "agents/node": ["django", "controlplane", "frontend", "dynaplane", "torch", "channels", "rest_framework"],
    # The rank processes: training (torch) plus reports through the broker (celery).
    "agents/runtime": ["django", "controlplane", "frontend", "dynaplane", "channels", "rest_framework"],
    "controlplane": ["torch", "dynaplane", "parallelism.engine", "parallelism.training", "parallelism.emulator",
                     "agents.node", "agents.runtime", "agents.processes"],
    # The inventory is the jobs app's floor: GPU writes and reads are the cluster app's, and
    # what a lost node means for a job is composed above it (jobs/node_loss.py).
    "controlplane/cluster": ["controlplane.jobs", "controlplane.emulation"],
    # Datasets are the jobs app's floor too: a job names one, never the reverse (a dataset's jobs are
    # read through the foreign key's reverse relation).
    "controlplane/datasets": ["controlplane.jobs", "controlplane.emulation", "controlplane.cluster"],
    # Exports sit above the jobs app (an export names a job's checkpoint), never the reverse.
    "controlplane/jobs": ["controlplane.exports"],
    "controlplane/common/events.py": ["controlplane.cluster", "controlplane.jobs", "controlplane.emulation"],
    "controlplane/common/errors.py": ["controlplane.cluster", "controlplane.jobs", "controlplane.emulation"],
    "frontend": ["torch", "dynaplane", "parallelism.engine", "parallelism.training", "parallelism.emulator",
                 "agents.node", "agents.runtime", "agents.processes"],
    "dynaplane": ["django", "controlplane", "frontend", "torch"],
}

# The jobs app's modules from the floor up: each imports only modules listed before it.
JOBS_ORDER = [
    # records and reads
    "lifecycle", "models", "metric_codec", "events", "selectors", "transfer_progress", "resume", "elastic_range",
    "elastic_trigger", "job_speakers",
    # writes every action shares: jobs and metrics, transitions, orders to the agents, failing a job
    "services", "job_logs", "transitions", "orders", "failures", "switch_orders", "preflight", "layouts",
    "elastic_settings",
    # pure previews of a resize
    "plan_preview", "proposals", "elastic_options", "resize_preview", "elastic_state",
    # actions
    "resize", "survivors", "restore", "node_loss", "timeouts", "reconcile", "scheduling", "elastic_apply",
    "reports", "ingest",
    # entry points
    "tasks", "api", "elastic_api", "consumers", "admin", "apps",
]

PROJECT = ("agents", "parallelism", "controlplane", "frontend", "dynaplane", "benchmarks", "tests")
SOURCES = ("agents", "parallelism", "controlplane", "frontend", "dynaplane", "benchmarks", "manage.py")


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


def _module_file(module: str, root: Path) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _edges(path: Path, root: Path) -> list[tuple[int, Path, str]]:
    """(line, file imported, names) for every import of a project file, at any depth.
    `from pkg import mod` points at pkg/mod.py when that is a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT and (target := _module_file(alias.name, root)):
                    out.append((node.lineno, target, ""))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in PROJECT:
            for alias in node.names:
                target = _module_file(f"{node.module}.{alias.name}", root) or _module_file(node.module, root)
                if target is not None:
                    out.append((node.lineno, target, alias.name))
    return out


def _files(root: Path, tops=SOURCES) -> list[Path]:
    found = []
    for top in tops:
        base = root / top
        found += [base] if base.is_file() else sorted(base.rglob("*.py")) if base.is_dir() else []
    return [p for p in found if "migrations" not in p.parts]


def _cycles(root: Path, tops=SOURCES) -> list[list[str]]:
    """Every strongly connected set of more than one file in the import graph (Tarjan)."""
    files = _files(root, tops)
    graph = {p: sorted({t for _, t, _ in _edges(p, root) if t != p and t.name != "__init__.py"}) for p in files}
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on: set[Path] = set()
    found: list[list[str]] = []

    def visit(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(str(w.relative_to(root)))
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _private_imports(root: Path, tops) -> list[str]:
    bad = []
    for path in _files(root, tops):
        for line, target, name in _edges(path, root):
            if name.startswith("_") and not name.startswith("__") and target != path:
                bad.append(f"{path.relative_to(root)}:{line} imports {name} from {target.relative_to(root)}")
    return bad


def test_no_import_loops() -> None:
    assert _cycles(ROOT) == []


def test_no_module_imports_another_modules_private_names() -> None:
    assert _private_imports(ROOT, (*SOURCES, "tests")) == []


def test_the_jobs_modules_import_only_the_ones_below_them() -> None:
    jobs = ROOT / "controlplane" / "jobs"
    modules = sorted(p.stem for p in jobs.glob("*.py") if p.stem != "__init__")
    assert sorted(JOBS_ORDER) == modules, "every module of controlplane/jobs has its place in JOBS_ORDER"
    bad = []
    for name in JOBS_ORDER:
        path = jobs / f"{name}.py"
        for line, target, _ in _edges(path, ROOT):
            if target.parent == jobs and target.stem in JOBS_ORDER \
                    and JOBS_ORDER.index(target.stem) >= JOBS_ORDER.index(name):
                bad.append(f"jobs/{name}.py:{line} imports jobs/{target.stem}.py, which is not below it")
    assert bad == []


def test_the_graph_checks_catch_a_loop_and_a_private_import(tmp_path) -> None:
    pkg = tmp_path / "agents"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from agents.b import _hidden\n")
    (pkg / "b.py").write_text("def f():\n    from agents import a\n")
    assert _cycles(tmp_path, ("agents",)) == [["agents/a.py", "agents/b.py"]]
    assert _private_imports(tmp_path, ("agents",)) == ["agents/a.py:1 imports _hidden from agents/b.py"]


def test_the_checker_catches_a_violation(tmp_path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("import os\nfrom django.db import models\n")
    assert _violations("pkg", ["django"], root=tmp_path) == ["pkg/m.py:2 imports django.db"]


def test_importing_parallelism_layout_does_not_import_torch_or_django() -> None:
    import subprocess
    import sys

    code = ("import sys, parallelism.layout.spec, parallelism.planner.plan, agents.protocol; "
            "print(sorted(m for m in ('torch', 'django', 'celery') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
