"""Training with online layout switches, one process per rank (what `dynaplane train` runs).

Every process of the union world (the largest layout's size) runs `train_rank`: ranks
outside the current layout wait at the next switch. At a switch step, at the step
boundary: the trainer hands over its shards, the scalars (step, data position, RNG) go
from rank 0 to everyone, every rank plans the same transition and checks fingerprints,
the engine moves the state, a layout-independent digest of every logical tensor is
compared before and after (any difference fails the switch and names the tensor), and a
trainer for the new layout adopts the new shards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from agents.engine.digest import compare_digests, owned_keys, state_digests, unchanged_keys
from agents.engine.execute import execute_plan, preallocate, prepare
from agents.engine.progress import WaveRecorder
from agents.engine.shards import Key, LocalShard
from agents.layout.catalog import get_config, get_model
from agents.layout.placement import place
from agents.layout.plan import PlanOptions, plan_routes
from agents.training.hetero import HeteroTrainer, check_hetero_trainable
from agents.training.parallel import (ParallelTrainer, StepResult, TrainConfig, TrainingError, TrainScalars,
                                      check_trainable, initial_shards)


@dataclass(frozen=True)
class Switch:
    step: int      # switch before this step runs (after `step` steps in the old layout)
    layout: str


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


@dataclass
class RankLog:
    steps: list[StepResult] = field(default_factory=list)
    switches: list[SwitchReport] = field(default_factory=list)


def parse_switch(text: str) -> Switch:
    """'STEP:LAYOUT', e.g. '20:tp=2,pp=1,dp=2,zero=1'."""
    step, sep, layout = text.partition(":")
    if not sep or not step.strip().isdigit() or not layout.strip():
        raise TrainingError(f"--switch {text!r}: expected STEP:LAYOUT, e.g. 20:tp=2,pp=1,dp=2,zero=1")
    return Switch(int(step), layout.strip())


def union_world(config: TrainConfig, layout: str, switches: list[Switch]) -> int:
    spec = get_model(config.model)
    return max(place(spec, lay).world for lay in [layout, *(s.layout for s in switches)])


def check_schedule(steps: int, switches: list[Switch]) -> None:
    last = 0
    for s in switches:
        if not 0 < s.step < steps or s.step <= last:
            raise TrainingError(f"switch at step {s.step}: switch steps must increase and lie in 1..{steps - 1}")
        last = s.step


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
                   gpus_per_node: int = 8) -> PreparedSwitch:
    plan = plan_routes(spec, src, dst, PlanOptions(gpus_per_node=gpus_per_node, staging_bytes=staging_bytes))
    program = prepare(plan, rank)
    plan.waves  # noqa: B018 (the predicted memory wave, cached on the plan: the report needs it)
    dst_rank = plan.dst_rank(rank)
    return PreparedSwitch(plan, program, preallocate(plan, program) if joining else None, unchanged_keys(plan),
                          owned_keys(plan.src, rank),
                          owned_keys(plan.dst, plan.dst.world if dst_rank is None else dst_rank))


def switch_state(spec, shards: dict[Key, LocalShard], scalars: TrainScalars, src: str, dst: str, rank: int, *,
                 staging_bytes: int = 64 * 2**20, gpus_per_node: int = 8, prepared: PreparedSwitch | None = None,
                 on_verify=None, on_round=None) -> tuple[dict[Key, LocalShard], TrainScalars, SwitchReport]:
    """Move handed-over state from layout src to dst; every rank of the union world calls
    this. Consumes `shards` (the engine frees each as soon as it has been sent).
    `on_verify(transfer_seconds)` is called when the transfer is done and the digests are
    about to be compared; `on_round(done, rounds, moved_bytes, wave)` after each round
    (moved_bytes: the plan's network bytes of the rounds done; wave: WaveRecorder.wave)."""
    phases: dict[str, float] = {}
    clock = time.perf_counter()
    box = [scalars]
    dist.broadcast_object_list(box, src=0)  # rank 0 is in every layout
    scalars = box[0]
    phases["scalars"], clock = time.perf_counter() - clock, time.perf_counter()
    prepared = prepared or prepare_switch(spec, src, dst, rank, not shards, staging_bytes=staging_bytes,
                                          gpus_per_node=gpus_per_node)
    phases["plan"] = time.perf_counter() - clock
    plan, program, ready = prepared.plan, prepared.program, prepared.ready
    digest_started = time.perf_counter()
    before = state_digests(plan.src, rank, shards, skip=prepared.unchanged, owned=prepared.owned_src)
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
    dist.barrier()
    started = time.perf_counter()
    phases["barrier"] = started - clock
    new: dict[Key, LocalShard] = execute_plan(plan, rank, shards, sample=recorder, program=program, ready=ready)
    shards.clear()
    seconds = phases["transfer"] = time.perf_counter() - started
    if on_verify is not None:
        on_verify(seconds)
    verify_started = time.perf_counter()
    dst_rank = plan.dst_rank(rank)  # this process's rank in the new layout (a device map may renumber)
    after = state_digests(plan.dst, plan.dst.world if dst_rank is None else dst_rank, new, skip=prepared.unchanged,
                          owned=prepared.owned_dst)
    checks = compare_digests(spec, before, after)  # raises VerificationError naming the tensors that differ
    phases["digest_after"] = time.perf_counter() - verify_started
    verify_seconds = phases["digest_after"] + before_seconds  # both digests: the check's whole cost
    clock = time.perf_counter()
    waves: list = [None] * dist.get_world_size()
    dist.all_gather_object(waves, recorder.wave)  # small: 2 * rounds + 1 integers per rank
    torch.set_rng_state(scalars.rng)
    _, predicted = plan.waves
    phases["waves"] = time.perf_counter() - clock
    report = SwitchReport(scalars.step, str(plan.src.layout), str(plan.dst.layout), seconds, verify_seconds,
                          plan.network_bytes, len(plan.rounds), max(start_bytes, recorder.peak),
                          int(predicted[:, rank].max(initial=0)) if rank < plan.world else 0, True, plan.fingerprint,
                          measured_waves=waves, checks=checks, phases=phases)
    return new, scalars, report


def check_layout(config: TrainConfig, layout: str) -> None:
    """Raise TrainingError (or LayoutError) naming why the model's trainer cannot train
    `layout`: checked for every layout of a schedule before any rank starts, so a switch is
    never refused after the state has left the old layout."""
    placement = place(get_model(config.model), layout)
    if get_config(config.model).encoder is not None:
        check_hetero_trainable(config, placement)
    else:
        check_trainable(config, placement)


def build_trainer(config: TrainConfig, layout: str, rank: int, shards: dict[Key, LocalShard],
                  scalars: TrainScalars | None, *, meshes=None) -> ParallelTrainer | HeteroTrainer:
    """The trainer for the model: HeteroTrainer (a layout per module, issue 8) for models
    with an encoder, whatever the layout string (a plain one gives both modules the same
    layout), else ParallelTrainer. Collective: every rank of the default group calls it,
    unless `meshes` (the `meshes` of a trainer of the same layout) are given."""
    if get_config(config.model).encoder is not None:
        return HeteroTrainer(config, layout, rank, shards, scalars, meshes=meshes)
    return ParallelTrainer(config, layout, rank, shards, scalars, meshes=meshes)


def switch_trainer(trainer: ParallelTrainer | HeteroTrainer, layout: str,
                   **options) -> tuple[ParallelTrainer | HeteroTrainer, SwitchReport]:
    """Hand a live trainer's state over to a trainer for `layout`, at a step boundary. For a
    multimodal model the plan moves each module's tensors from that module's old layout and
    ranks to its new ones (homogeneous, colocated and non-colocated alike)."""
    src = str(trainer.placement.layout)
    shards, scalars = trainer.hand_over()
    new, scalars, report = switch_state(trainer.spec, shards, scalars, src, layout, trainer.rank, **options)
    return build_trainer(trainer.config, layout, trainer.rank, new, scalars), report


def train_rank(rank: int, world: int, config: TrainConfig, layout: str, steps: int, switches: list[Switch],
               staging_bytes: int = 64 * 2**20, on_step=None) -> RankLog:
    """The whole run on one rank; `on_step(rank, StepResult | SwitchReport)` sees progress."""
    check_schedule(steps, switches)
    for text in [layout, *(s.layout for s in switches)]:
        check_layout(config, text)
    placement = place(get_model(config.model), layout)
    shards = initial_shards(config.model, placement, rank, config.seed) if rank < placement.world else {}
    trainer = build_trainer(config, layout, rank, shards, TrainScalars())
    del shards
    pending = {s.step: s for s in switches}
    log = RankLog()
    for step in range(steps):
        if step in pending:
            trainer, report = switch_trainer(trainer, pending[step].layout, staging_bytes=staging_bytes)
            log.switches.append(report)
            if on_step:
                on_step(rank, report)
        result = trainer.step()
        if result is not None:
            log.steps.append(result)
            if on_step:
                on_step(rank, result)
    return log
