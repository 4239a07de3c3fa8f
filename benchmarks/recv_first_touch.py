"""Why the engine touches receive buffers before posting them (parallelism/engine/execute.py
_prefault): one pair of gloo ranks (of 4) exchanges a buffer both ways, receiving into a
buffer that is (a) reused, (b) freshly allocated, (c) freshly allocated and touched once
per page before the timer starts. Prints GB/s per repeat and the cost of the touch.

    .venv/bin/python -m benchmarks.recv_first_touch [MiB]
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from parallelism.engine.launch import run_ranks

PAGE = 4096


def _exchange(rank: int, world: int, nbytes: int, mode: str) -> list[float]:
    peer = {1: 2, 2: 1}.get(rank)
    send = torch.ones(nbytes, dtype=torch.uint8)
    recv = torch.empty(nbytes, dtype=torch.uint8)
    rates = []
    for _ in range(4):
        if mode != "reused":
            del recv
            recv = torch.empty(nbytes, dtype=torch.uint8)
            if mode == "touched":
                recv[::PAGE].zero_()
        dist.barrier()
        started = time.perf_counter()
        if peer is not None:
            ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        dist.barrier()
        rates.append(nbytes / (time.perf_counter() - started) / 1e9)
    return rates


def main() -> None:
    nbytes = int(float(sys.argv[1]) if len(sys.argv) > 1 else 374) * 2**20
    for mode in ("reused", "fresh", "touched"):
        rates = run_ranks(4, _exchange, nbytes, mode, timeout_s=300)[1]
        print(f"{mode:8s} GB/s per repeat: {', '.join(f'{r:.2f}' for r in rates)}")
    torch.set_num_threads(1)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    started = time.perf_counter()
    buf[::PAGE].zero_()
    print(f"touching {nbytes / 2**20:.0f} MiB once per page: {time.perf_counter() - started:.3f} s")


if __name__ == "__main__":
    main()
