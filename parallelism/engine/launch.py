"""run_ranks(n, fn): n local processes joined in one gloo process group (file:// rendezvous
in a fresh folder, so runs never collide on ports), each calling fn(rank, world, *args).

Used by the tests and by local multi-process commands. Every group gets a timeout; a rank
that raises or dies fails the whole run with its traceback, never a hang.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from parallelism.engine.errors import EngineError


def _take_environ(env: dict[str, str]) -> None:
    """In a forkserver's child: its environment is the server's from its start; take the caller's."""
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


def call_with_environ(env: dict[str, str], fn: Callable, *args: Any) -> Any:
    """fn(*args) in a process of rank_context(), with the caller's environment `env`."""
    _take_environ(env)
    return fn(*args)


def _entry(rank: int, world: int, init_file: str, timeout_s: float, fn: Callable, args: tuple, results,
           env: dict[str, str], backend: str = "gloo") -> None:
    _take_environ(env)
    import torch
    import torch.distributed as dist

    # One intra-op thread per rank: n ranks on a few CPU cores otherwise oversubscribe them
    # (2 threads x 4 ranks on 2 cores made collectives 10-50x slower).
    torch.set_num_threads(int(os.environ.get("DYNAPLANE_RANK_THREADS", "1")))
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            # Plain pickle copies tensors into the message. The queue's own pickler (torch
            # registers its reductions there) would pass them as shared memory by file
            # descriptor, served by this process: gone if it exits before the caller reads
            # the message (CI saw FileNotFoundError on the sharer's socket).
            results.put((rank, "ok", pickle.dumps(fn(rank, world, *args), protocol=pickle.HIGHEST_PROTOCOL)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


# glibc hands blocks above the mmap threshold back to the OS when they are freed, so every
# new shard a switch allocates page-faults on first touch (measured: about a third of a
# 4-rank switch). Keeping freed memory in the heap lets a destination shard reuse the
# pages of the source shards just sent, as the CUDA caching allocator does on GPUs. glibc
# reads these at process start, so they are set for the children; a user's own wins.
RANK_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)}


# Rank processes are forked from a forkserver that has imported torch once: a spawned rank
# imports torch itself, which took 2 s a rank on the idle 2-core machine and 10 s under
# load (4 ranks: 40-50 s before the first collective; forked from the server: 0.3 s). The
# server only imports, so every rank still starts with torch's process-group and mesh
# registries empty, as a fresh interpreter would. torch._dynamo too: FakeTensorMode imports
# it on first use (1-2 s), in every stage-class process of the emulator's tracer.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def rank_context() -> mp.context.BaseContext:
    """The multiprocessing context rank processes start from (forkserver, torch preloaded),
    its server running with RANK_MALLOC_ENV: glibc reads it when a process starts, and
    the forks inherit the heap settings."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = {k: os.environ.get(k) for k in RANK_MALLOC_ENV}
    os.environ.update({k: v for k, v in RANK_MALLOC_ENV.items() if saved[k] is None})
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
    return ctx


def rank_env() -> dict[str, str]:
    """The environment of a rank process: the caller's, with RANK_MALLOC_ENV unless set."""
    return {**RANK_MALLOC_ENV, **os.environ}


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0,
              backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world, *args) on `world` processes; return their results by rank.
    backend "nccl": rank r on GPU r (EngineError when there are fewer GPUs than ranks)."""
    if backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world:
            raise EngineError(f"NCCL ranks run one per GPU: {world} ranks need {world} GPUs, this machine has {gpus}")
    ctx = rank_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dynaplane-ranks-") as folder:
        init_file = os.path.join(folder, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(r, world, init_file, timeout_s, fn, args, results, rank_env(),
                                                  backend), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s + 30
        try:
            while len(out) + len(errors) < world:
                try:
                    rank, status, value = results.get(timeout=0.5)
                    if status == "ok":
                        value = pickle.loads(value)
                    (out if status == "ok" else errors)[rank] = value
                    continue
                except queue.Empty:
                    pass
                for r, p in enumerate(procs):  # a rank that died without a word
                    if r not in out and r not in errors and p.exitcode is not None and results.empty():
                        errors[r] = f"rank {r} died with exit code {p.exitcode} and no report"
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(out) - set(errors))
                    raise EngineError(f"ranks {missing} gave no result within {timeout_s + 30:.0f} s")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        if errors:
            first = min(errors, key=lambda r: (failure_rank(errors[r]), r))
            each = "; ".join(f"rank {r}: {errors[r].strip().splitlines()[0][:160]}" for r in sorted(errors))
            raise EngineError(f"{len(errors)} of {world} ranks failed ({each}); rank {first}:\n{errors[first]}")
    return [out[r] for r in range(world)]


# How a peer's failure shows on the ranks it takes down with it (gloo's words).
PEER_WORDS = ("closed by peer", "reset by peer", "Connection refused", "Broken pipe", "Timed out")


def failure_rank(error: str) -> int:
    """Which failure to show first: 0 a rank's own traceback, 1 a rank that died without a
    word (a signal, the OOM killer: the likely cause of its peers' errors), 2 a rank that
    only saw a peer go (its connection closed or reset, a collective timed out)."""
    if "died with exit code" in error:
        return 1
    return 2 if any(word in error.splitlines()[0] for word in PEER_WORDS) else 0
