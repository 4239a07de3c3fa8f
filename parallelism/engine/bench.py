"""`dynaplane bench switch`: the same state switched by the engine and by the
checkpoint-restart baseline (DCP save in layout A, load resharded into layout B), plus the
raw point-to-point bandwidth of the backend measured in the same run.

Every rank runs bench_rank(); summarize() turns the per-rank results into docs/contracts.md
section 6's JSON object.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist

from parallelism.engine.checkpoint import check_expressible, checkpoint_switch
from parallelism.engine.digest import compare_digests, state_digests
from parallelism.engine.errors import EngineError
from parallelism.engine.execute import execute_plan, preallocate, prepare, round_messages
from parallelism.engine.shards import collective_device
from parallelism.engine.state_fill import filled_shards
from parallelism.layout.catalog import get_model
from parallelism.planner.plan import PlanOptions, plan_routes

P2P_BYTES = 64 * 2**20


def p2p_gbps(rank: int, world: int, nbytes: int = P2P_BYTES, repeats: int = 3) -> float:
    """Bytes per second one rank moves to a partner (pairs 0-1, 2-3, ...), both directions at
    once as the engine does, best of `repeats`. An odd last rank only takes part in barriers."""
    partner = rank ^ 1
    device = collective_device()
    send = torch.ones(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(repeats):
        dist.barrier()
        if partner < world:
            started = time.perf_counter()
            ops = [dist.P2POp(dist.isend, send, partner), dist.P2POp(dist.irecv, recv, partner)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            _sync(device)
            best = max(best, nbytes / (time.perf_counter() - started) / 1e9)
    dist.barrier()
    return best


def replay_seconds(program, model) -> float:
    """The switch's exact messages (same peers, sizes and rounds) with ready-made buffers:
    what the transport alone needs for this traffic, without packing or unpacking."""
    rounds = []  # buffers touched ahead, as a transport benchmark's are (see execute._prefault)
    device = collective_device()
    for slices in program.rounds:
        out, inc = round_messages(model, slices)
        rounds.append(([(peer, tag, torch.zeros(n, dtype=torch.uint8, device=device))
                        for peer, sizes in sorted(out.items()) for tag, n in enumerate(sizes)],
                       [(peer, tag, torch.zeros(n, dtype=torch.uint8, device=device))
                        for peer, sizes in sorted(inc.items()) for tag, n in enumerate(sizes)]))
    dist.barrier()
    started = time.perf_counter()
    for sends, recvs in rounds:
        ops = ([dist.P2POp(dist.isend, b, peer, None, tag) for peer, tag, b in sends]
               + [dist.P2POp(dist.irecv, b, peer, None, tag) for peer, tag, b in recvs])
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    dist.barrier()
    return time.perf_counter() - started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_rank(rank: int, world: int, model_name: str, src: str, dst: str, staging_mb: float) -> dict:
    """One rank's figures; the state lives where the backend's collectives do (NCCL: this
    rank's GPU, gloo: the host)."""
    model = get_model(model_name)
    device = collective_device()
    plan = plan_routes(model, src, dst, PlanOptions(gpus_per_node=world, staging_bytes=int(staging_mb * 2**20)))
    if max(plan.src.world, plan.dst.world) > world:
        raise EngineError(f"--world {world} is smaller than the layouts need ({plan.src.world}, {plan.dst.world})")
    check_expressible(plan.src)
    check_expressible(plan.dst)
    old = filled_shards(plan.src, rank, device)
    before = state_digests(plan.src, rank, old)
    peak = [0]

    def sample(label: str, live: int) -> None:
        peak[0] = max(peak[0], live)

    started = time.perf_counter()
    program = prepare(plan, rank)  # done while training runs in the product: not part of the pause
    ready = preallocate(plan, program, device) if not old else None  # a joining rank, idle until the switch
    prepare_seconds = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    new = execute_plan(plan, rank, old, sample=sample, program=program, ready=ready)
    _sync(device)
    dist.barrier()
    switch_seconds = time.perf_counter() - started
    after = state_digests(plan.dst, rank, new)
    try:
        compare_digests(model, before, after)
        digests_match = True
    except EngineError:
        digests_match = False

    with tempfile.TemporaryDirectory(prefix="dynaplane-ckpt-") as folder:
        path = folder if rank == 0 else None
        shared = [path]
        dist.broadcast_object_list(shared, src=0)
        old = filled_shards(plan.src, rank, device)
        dist.barrier()
        started = time.perf_counter()
        loaded = checkpoint_switch(plan.src, plan.dst, rank, old, os.path.join(shared[0], "ckpt"))
        _sync(device)
        dist.barrier()
        checkpoint_seconds = time.perf_counter() - started
    same_as_checkpoint = set(loaded) == set(new) and all(torch.equal(loaded[k].data, new[k].data) for k in new)
    _, predicted = plan.waves
    stats = plan.stats
    return {
        "device": str(device),
        "switch_seconds": switch_seconds, "checkpoint_seconds": checkpoint_seconds,
        "prepare_seconds": prepare_seconds,
        "digests_match": digests_match, "same_as_checkpoint": same_as_checkpoint,
        "peak_measured": peak[0],
        # The memory target for this rank: max(source bytes, destination bytes) + staging.
        "peak_bound": (float(max(plan.waves[0][0, rank], plan.waves[0][-1, rank])) + plan.options.staging_bytes
                       if rank < plan.world else 0.0),
        "peak_predicted": float(predicted[:, rank].max(initial=0)) if rank < predicted.shape[1] else 0.0,
        "sent_bytes": float((stats.send_intra + stats.send_inter)[:, rank].sum()) if rank < plan.world else 0.0,
        "received_bytes": float((stats.recv_intra + stats.recv_inter)[:, rank].sum()) if rank < plan.world else 0.0,
        "p2p_gbps": p2p_gbps(rank, world),
        "replay_seconds": replay_seconds(program, model),
        "summary": plan.summary() if rank == 0 else None,
    }


def summarize(model: str, world: int, src: str, dst: str, ranks: list[dict]) -> dict:
    """docs/contracts.md section 6. achieved_gbps: bytes the busiest rank moved (the larger of what
    it sent and received) per second of switch. p2p_gbps: one pair of ranks exchanging a
    64 MiB buffer (the raw figure); replay_gbps: the same busiest-rank bytes over the time
    the backend alone needs for the switch's exact messages (so on a machine whose cores are
    shared by all ranks, the fair ceiling for this traffic)."""
    plan = ranks[0]["summary"]
    switch = max(r["switch_seconds"] for r in ranks)
    checkpoint = max(r["checkpoint_seconds"] for r in ranks)
    busiest = max(max(r["sent_bytes"], r["received_bytes"]) for r in ranks)
    p2p = [r["p2p_gbps"] for r in ranks if r["p2p_gbps"] > 0]
    return {
        "model": model, "world": world, "src": src, "dst": dst,
        "switch_seconds": switch, "checkpoint_seconds": checkpoint, "speedup": checkpoint / switch,
        "prepare_seconds": max(r["prepare_seconds"] for r in ranks),
        "network_bytes": plan["network_bytes"], "rounds": plan["rounds"],
        "achieved_gbps": busiest / switch / 1e9,
        "p2p_gbps": min(p2p) if p2p else 0.0,
        "replay_gbps": busiest / max(r["replay_seconds"] for r in ranks) / 1e9,
        "peak_bytes_measured": [r["peak_measured"] for r in ranks],
        "peak_bytes_predicted": [int(r["peak_predicted"]) for r in ranks],
        "peak_bytes_bound": [int(r["peak_bound"]) for r in ranks],
        "bitexact": all(r["digests_match"] and r["same_as_checkpoint"] for r in ranks),
    }
