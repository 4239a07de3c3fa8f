"""Measured op rates at the shapes a trace holds, and how the cost model reads them (pure).

`dynaplane calibrate` can time the very GEMMs and fused attentions a trace contains on the
local device, each with its own operand layout (recorder.matmul_form): on a CPU the same
GEMM runs at rates up to 9x apart by layout and falls off for narrow or huge operands in
ways no single efficiency curve captures (docs/benchmarks-history.md, sessions 5 and 6). The
profile keeps them as

    matmul_table       {dtype: {form: [[batch, m, n, k, flop_per_second], ...]}}
    attention_table    {"forward" | "backward": {dtype: [[batch, heads, seq_q, seq_kv, head_dim,
                                                          flop_per_second], ...]}}
    op_bandwidth_table {aten name: [[bytes, bytes_per_second], ...]} (memory-bound ops by size)

(FLOPs counted as the recorder counts them: causal attention at its causal share). An op
whose shape was measured gets that rate; another gets the rate of the measured shape
nearest to it in log space (same dtype and form), since GEMM efficiency varies smoothly
with log-size; with no entry for its dtype/form the profile's efficiency model applies.

Worked example: the table holds nt GEMMs (1, 128, 768, 768) at 400 GFLOP/s and
(1, 128, 50304, 768) at 130 GFLOP/s; an nt GEMM (1, 128, 3072, 768) is log-distance
|ln(3072/768)| = 1.39 from the first and |ln(3072/50304)| = 2.80 from the second, so it
runs at 400 GFLOP/s.
"""
from __future__ import annotations

import math

from parallelism.emulator.errors import require

DIRECTIONS = ("forward", "backward")


def gemm_key(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a recorded matmul shape, (m, n, k) or (batch, m, n, k)."""
    if len(shape) == 3:
        return (1, *shape)
    return tuple(shape)  # type: ignore[return-value]


def nearest_rate(entries: list, dims: tuple[int, ...]) -> float | None:
    """The rate (last column) of the entry whose leading dims are nearest to `dims` in
    sum of |log ratio|; exact matches win. None when there are no entries."""
    best, best_distance = None, math.inf
    for entry in entries:
        distance = sum(abs(math.log(max(a, 1) / max(b, 1))) for a, b in zip(entry[:-1], dims))
        if distance < best_distance:
            best, best_distance = entry[-1], distance
    return best


def matmul_rate(table: dict, dtype: str, form: str, shape: tuple[int, ...]) -> float | None:
    """Measured FLOP/s for a GEMM, or None when the table cannot say (no shape, or no
    entries for this dtype; a form that was not measured uses the nearest of any form)."""
    if len(shape) not in (3, 4) or not table:
        return None
    by_form = table.get(dtype) or table.get("bf16" if dtype == "fp16" else dtype) or {}
    entries = by_form.get(form) or [e for rows in by_form.values() for e in rows]
    return nearest_rate(entries, gemm_key(shape)) if entries else None


def attention_rate(table: dict, name: str, dtype: str, shape: tuple[int, ...]) -> float | None:
    """Measured FLOP/s for a fused attention op (forward or backward by its name)."""
    if len(shape) != 5 or not table:
        return None
    direction = "backward" if "backward" in name else "forward"
    entries = (table.get(direction) or {}).get(dtype)
    return nearest_rate(entries, tuple(shape)) if entries else None


def bandwidth_at(points: list, nbytes: float) -> float:
    """Bytes/s of a memory-bound op moving `nbytes`, from [[bytes, bytes_per_second], ...]
    measured at ascending sizes: interpolated in log-size, clamped at both ends (small ops
    run from the caches, large ones from DRAM)."""
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, r0), (b1, r1) in zip(points, points[1:]):
        if nbytes <= b1:
            w = math.log(nbytes / b0) / math.log(b1 / b0)
            return r0 * (1 - w) + r1 * w  # this form is exact at both ends (r0 + w(r1 - r0) is not at w = 1)
    return points[-1][1]


def check_tables(name: str, matmul_table, attention_table, op_bandwidth_table) -> None:
    """Profile validation: the shapes above, positive finite numbers."""
    require(isinstance(op_bandwidth_table, dict), f"profile {name}: op_bandwidth_table must be an object")
    for op, points in op_bandwidth_table.items():
        _check_rows(f"profile {name}: op_bandwidth_table[{op!r}]", points, 2)
        require(all(a[0] < b[0] for a, b in zip(points, points[1:])),
                f"profile {name}: op_bandwidth_table[{op!r}]: sizes must ascend")
    require(isinstance(matmul_table, dict), f"profile {name}: matmul_table must be an object")
    for dtype, by_form in matmul_table.items():
        require(isinstance(by_form, dict), f"profile {name}: matmul_table[{dtype!r}] must be an object")
        for form, rows in by_form.items():
            _check_rows(f"profile {name}: matmul_table[{dtype!r}][{form!r}]", rows, 5)
    require(isinstance(attention_table, dict), f"profile {name}: attention_table must be an object")
    for direction, by_dtype in attention_table.items():
        require(direction in DIRECTIONS,
                f"profile {name}: attention_table key {direction!r} must be one of {DIRECTIONS}")
        require(isinstance(by_dtype, dict), f"profile {name}: attention_table[{direction!r}] must be an object")
        for dtype, rows in by_dtype.items():
            _check_rows(f"profile {name}: attention_table[{direction!r}][{dtype!r}]", rows, 6)


def _check_rows(where: str, rows, width: int) -> None:
    require(isinstance(rows, list) and rows, f"{where} must be a non-empty list")
    for row in rows:
        require(isinstance(row, (list, tuple)) and len(row) == width and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in row),
            f"{where}: row {row!r} must be {width} positive numbers (dims..., flop_per_second)")
