"""One rank's part in a layout switch: move handed-over state from one layout to another
and verify it. The one switch path of `dynaplane train` (parallelism/training/run.py) and of
the node agents' rank processes (agents/runtime/worker.py, orphan.py); they differ only in
the world they run it in, passed as `group` (default: the default group, rank 0 of which
is in every layout). Training state is opaque here: `scalars` needs `.rng` and `.step`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallelism.engine.digest import compare_digests, owned_keys, state_digests, unchanged_keys
from parallelism.engine.execute import execute_plan, preallocate, prepare
from parallelism.engine.progress import WaveRecorder
from parallelism.engine.shards import Key, LocalShard
from parallelism.planner.plan import PlanOptions, plan_routes


@dataclass
class SwitchReport:
    step: int
    src: str
    dst: str
    seconds: float            # state transfer (the pause beyond the step boundary)
    verify_seconds: float
    network_bytes: int
    rounds: int
    peak_bytes: int           # measured on this rank: state + staging
    predicted_peak_bytes: int  # the planner's prediction for this rank
    verified: bool
    fingerprint: str
    # every rank's measured state bytes through the switch (WaveRecorder.wave), rank order
    measured_waves: list[list[int]] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)  # per logical tensor (digest.tensor_checks)
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each step of switch_state, in order
    rank: int | None = None   # this process's rank in the new layout (None: it leaves)
    renumbered: bool = False  # a device map gave some rank another process than its number


@dataclass
class PreparedSwitch:
    """What a rank can work out before the pause: the plan, its own program, the state
    the switch leaves untouched (not hashed) and, on a joining rank (no state yet), its new
    shards, allocated and touched."""

    plan: object
    program: object
    ready: dict | None
    unchanged: frozenset = frozenset()
    owned_src: set | None = None  # the keys this rank's digests count, before and after
    owned_dst: set | None = None


def prepare_switch(spec, src: str, dst: str, rank: int, joining: bool, *, staging_bytes: int = 64 * 2**20,
                   gpus_per_node: int = 8, process_of=None) -> PreparedSwitch:
    """`rank`: this process in the union world; `process_of`: the device map (the process of
    each destination rank; None: process d takes rank d)."""
    plan = plan_routes(spec, src, dst, PlanOptions(gpus_per_node=gpus_per_node, staging_bytes=staging_bytes),
                       process_of=process_of)
    program = prepare(plan, rank)
    plan.waves  # noqa: B018 (the predicted memory wave, cached on the plan: the report needs it)
    dst_rank = plan.dst_rank(rank)
    return PreparedSwitch(plan, program, preallocate(plan, program) if joining else None, unchanged_keys(plan),
                          owned_keys(plan.src, rank),
                          owned_keys(plan.dst, plan.dst.world if dst_rank is None else dst_rank))


def switch_state(spec, shards: dict[Key, LocalShard], scalars, src: str, dst: str, rank: int, *,
                 staging_bytes: int = 64 * 2**20, gpus_per_node: int = 8, prepared: PreparedSwitch | None = None,
                 on_verify=None, on_round=None, on_transfer=None, group=None,
                 process_of=None) -> tuple[dict[Key, LocalShard], object, SwitchReport]:
    """Move handed-over state from layout src to dst; every rank of the union world calls
    this (`group`: that world; default the default group; `rank`: this process in it). Consumes `shards` (the engine
    frees each as soon as it has been sent).
    `on_transfer()` is called when every rank is past the barrier before the transfer (its
    rounds are bounded by the staging budget: the caller may wait less for a peer in them);
    `on_verify(transfer_seconds)` when the transfer is done and the digests are about to be
    compared; `on_round(done, rounds, moved_bytes, wave)` after each round
    (moved_bytes: the plan's network bytes of the rounds done; wave: WaveRecorder.wave)."""
    phases: dict[str, float] = {}
    clock = time.perf_counter()
    box = [scalars]
    dist.broadcast_object_list(box, group_src=0, group=group)  # rank 0 is in every layout
    scalars = box[0]
    phases["scalars"], clock = time.perf_counter() - clock, time.perf_counter()
    prepared = prepared or prepare_switch(spec, src, dst, rank, not shards, staging_bytes=staging_bytes,
                                          gpus_per_node=gpus_per_node, process_of=process_of)
    phases["plan"] = time.perf_counter() - clock
    plan, program, ready = prepared.plan, prepared.program, prepared.ready
    digest_started = time.perf_counter()
    before = state_digests(plan.src, rank, shards, group, skip=prepared.unchanged, owned=prepared.owned_src)
    before_seconds = phases["digest_before"] = time.perf_counter() - digest_started
    start_bytes = sum(s.nbytes for s in shards.values())
    progress = None
    if on_round is not None:
        moved = [0, *(int(x) for x in (plan.stats.send_intra + plan.stats.send_inter).sum(axis=1).cumsum())]
        rounds = len(moved) - 1

        def progress(done: int, wave: list[int]) -> None:
            on_round(done, rounds, moved[min(done, rounds)], wave)
    recorder = WaveRecorder(progress)
    clock = time.perf_counter()
    dist.barrier(group=group)
    if on_transfer is not None:
        on_transfer()
    started = time.perf_counter()
    phases["barrier"] = started - clock
    new: dict[Key, LocalShard] = execute_plan(plan, rank, shards, group, sample=recorder, program=program, ready=ready)
    shards.clear()
    seconds = phases["transfer"] = time.perf_counter() - started
    if on_verify is not None:
        on_verify(seconds)
    verify_started = time.perf_counter()
    dst_rank = plan.dst_rank(rank)  # this process's rank in the new layout (a device map may renumber)
    after = state_digests(plan.dst, plan.dst.world if dst_rank is None else dst_rank, new, group,
                          skip=prepared.unchanged, owned=prepared.owned_dst)
    checks = compare_digests(spec, before, after)  # raises VerificationError naming the tensors that differ
    phases["digest_after"] = time.perf_counter() - verify_started
    verify_seconds = phases["digest_after"] + before_seconds  # both digests: the check's whole cost
    clock = time.perf_counter()
    waves: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(waves, recorder.wave, group=group)  # small: 2 * rounds + 1 integers per rank
    torch.set_rng_state(scalars.rng)
    _, predicted = plan.waves
    phases["waves"] = time.perf_counter() - clock
    report = SwitchReport(scalars.step, str(plan.src.layout), str(plan.dst.layout), seconds, verify_seconds,
                          plan.network_bytes, len(plan.rounds), max(start_bytes, recorder.peak),
                          int(predicted[:, rank].max(initial=0)) if rank < plan.world else 0, True, plan.fingerprint,
                          measured_waves=waves, checks=checks, phases=phases, rank=dst_rank,
                          renumbered=plan.renumbered > 0)
    return new, scalars, report
