"""Trace the real training program of any model for a target layout on fake tensors: one
front, `trace()`, for two programs (as torch DCP has one planner interface with several
implementations):
- trace_parallel.py: a decoder-only model, `ParallelTrainer` (one module, pipelined);
- trace_modules.py: a model with an encoder, `HeteroTrainer` (the encoder feeds the LLM's
  pipeline: the Trace's `inputs`).
A program names its symmetry classes (one rank of the target world stands for each),
the key a class's trace is cached under, how to trace a class and how to assemble the
Trace from the classes' parts. Here: each class not in the cache is traced in a fresh
process on torch's fake process group (nothing is allocated or sent; the program, its
shapes and its order are the real ones), and the parts are cached one file per class.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from parallelism.emulator import trace_modules, trace_parallel
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.trace import Trace
from parallelism.emulator.trace_build import TRACER_VERSION, TraceRequest

__all__ = ["TRACER_VERSION", "TraceRequest", "cache_dir", "in_fresh_processes", "program", "trace"]


def program(request: TraceRequest):
    """The traced program of a request's model: its trainer's, by the model's modules."""
    return trace_modules if len(request.tensors.modules) > 1 else trace_parallel


def cache_dir() -> Path:
    """DYNAPLANE_TRACE_CACHE, else the stack's var dir (agents run with DYNAPLANE_VAR_DIR),
    else ~/.cache/dynaplane/traces."""
    if os.environ.get("DYNAPLANE_TRACE_CACHE"):
        return Path(os.environ["DYNAPLANE_TRACE_CACHE"])
    if os.environ.get("DYNAPLANE_VAR_DIR"):
        return Path(os.environ["DYNAPLANE_VAR_DIR"]) / "traces"
    return Path.home() / ".cache" / "dynaplane" / "traces"


def trace(request: TraceRequest, *, use_cache: bool = True, progress=None) -> tuple[Trace, dict]:
    """The Trace of a configuration and facts about how it was made (classes, classes traced,
    seconds, cache hit: every class from the cache). Runs in this process on torch's fake
    process group."""
    started = time.perf_counter()
    impl = program(request)
    classes = impl.classes(request)
    parts, missing = {}, {}
    for key, members in classes.items():
        path = cache_dir() / f"{impl.class_key(request, key)}.json"
        if use_cache and path.exists():
            parts[key] = json.loads(path.read_text())
        else:
            missing[key] = members
    calls = {key: (_trace_class, (impl.__name__, request, key, members[0])) for key, members in missing.items()}
    for key, part in in_fresh_processes(calls, progress, impl.CLASS).items():
        parts[key] = part
        if use_cache:
            path = cache_dir() / f"{impl.class_key(request, key)}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(part, separators=(",", ":")))
            tmp.replace(path)
    return impl.assemble(request, parts), {"cached": not missing, "stages_traced": len(missing),
                                           "classes": len(classes), "trace_seconds": time.perf_counter() - started}


def _trace_class(program_name: str, request: TraceRequest, key: tuple, member: int) -> dict:
    """One class's part, in a fresh process; errors cross the process boundary as EmulatorError."""
    impl = trace_modules if program_name == trace_modules.__name__ else trace_parallel
    torch.set_num_threads(1)
    try:
        return impl.trace_class(request, key, member)
    except EmulatorError:
        raise
    except Exception as exc:  # torch errors may hold objects that cannot cross a process boundary
        raise EmulatorError(f"tracing {request.layout} ({impl.label(key, member)}) failed: "
                            f"{type(exc).__name__}: {exc}") from None


def in_fresh_processes(calls: dict, progress=None, what: str = "stage class") -> dict:
    """{key: (fn, args)} -> {key: fn(*args)}, each call in a fresh process (torch's
    process-group and mesh registries are global; a process forked from a server that has
    only imported torch, parallelism.engine.launch.rank_context, is a clean slate),
    DYNAPLANE_TRACE_WORKERS (2) at a time."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from parallelism.engine.launch import call_with_environ, rank_context

    if not calls:
        return {}
    workers = max(1, min(len(calls), int(os.environ.get("DYNAPLANE_TRACE_WORKERS", "2"))))
    out: dict = {}
    env = dict(os.environ)
    with ProcessPoolExecutor(workers, mp_context=rank_context(), max_tasks_per_child=1) as pool:
        futures = {pool.submit(call_with_environ, env, fn, *args): key for key, (fn, args) in calls.items()}
        for n, future in enumerate(as_completed(futures)):
            out[futures[future]] = future.result()
            if progress:
                progress(f"traced {what} {n + 1}/{len(calls)}")
    return out
