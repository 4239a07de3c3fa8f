"""The cluster page's GPUs in a compact form: 8,192 GPUs as dicts repeat the same keys and
strings (about 1 MiB of JSON); as rows of small integers into lookup tables they are ~150 KiB.

    {"tables": {"node": [...], "model": [...], "memory": [...], "state": [...], "job": [...]},
     "rows": [[node, index, model, memory, state, job], ...]}

Each row's node/model/memory/state/job is a position in its table; job -1: none. Pure: the
page's cluster-model.js reads it back (gpusFromCompact)."""
from __future__ import annotations

from collections.abc import Iterable

GpuRow = tuple[str, int, str, int, str, str | None]  # (node, index, model_name, memory_bytes, state, job)
FIELDS = ("node", "model", "memory", "state", "job")


def compact_gpus(rows: Iterable[GpuRow]) -> dict:
    tables: dict[str, list] = {field: [] for field in FIELDS}
    positions: dict[str, dict] = {field: {} for field in FIELDS}

    def position(field: str, value) -> int:
        found = positions[field].get(value)
        if found is None:
            found = positions[field][value] = len(tables[field])
            tables[field].append(value)
        return found

    out = []
    for node, index, model_name, memory_bytes, state, job in rows:
        out.append([position("node", node), index, position("model", model_name), position("memory", memory_bytes),
                    position("state", state), -1 if job is None else position("job", job)])
    return {"tables": tables, "rows": out}


def expand_gpus(compact: dict) -> list[dict]:
    """The GpuView dicts back (tests, and a reader that wants them)."""
    t = compact["tables"]
    return [{"node": t["node"][n], "index": i, "model_name": t["model"][m], "memory_bytes": t["memory"][b],
             "state": t["state"][s], "job": None if j < 0 else t["job"][j]} for n, i, m, b, s, j in compact["rows"]]
