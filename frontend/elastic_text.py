"""A job's elastic GPU range in words, for the templates: the Python twin of rangeText in
frontend/static/frontend/elastic-view.js (tests/test_elastic_view_js.py checks they agree).
A bound left empty (null) follows the job's current size (world_size), and the text says so."""
from __future__ import annotations


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"


def range_text(min_gpus: int | None, max_gpus: int | None, world_size: int) -> str:
    """(None, None, 2) -> "2 GPUs (follows the current size)"; (1, None, 2) -> "1–2 GPUs (max
    follows the current size)"; (2, 4, 2) -> "2–4 GPUs"."""
    lo = world_size if min_gpus is None else min_gpus
    hi = world_size if max_gpus is None else max_gpus
    span = _gpus(lo) if lo == hi else f"{lo}–{hi} GPUs"
    follows = [name for name, bound in (("min", min_gpus), ("max", max_gpus)) if bound is None]
    if len(follows) == 2:
        return f"{span} (follows the current size)"
    if follows:
        return f"{span} ({follows[0]} follows the current size)"
    return span
