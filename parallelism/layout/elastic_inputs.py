"""What the elastic scheduler decides on, and what it decides (pure values).

The scheduler (elastic_policy.decide) is a function of these: the healthy nodes, the jobs
(running and pending arrivals, each with the GPU counts it may take and the layout the
resize ranking picks for each), the settings (dampening, backoff, grow horizon) and the
cost model of a resize's pause, which is an explicit parameter: the online switch and a
stop-checkpoint-restart differ only in it.

Times are seconds on one clock (`now` and the jobs' `last_*_at`); the caller picks it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from parallelism.layout.errors import require

# Measured on the 2-core CPU host (docs/benchmarks.md, "Online resize vs stop-checkpoint-restart",
# session 17). Online, llama-124m: dp 2 -> 4 paused 1.46 s, of which 1.24 s moved 2.99 GB to
# the two joining ranks (1.2 GB/s per joining rank) and 0.22 s is fixed cost; dp 4 -> 2 paused
# 0.18 s. Stop-checkpoint-restart: llama-124m (1.74 GB of model state per GPU: 124M params x
# 14 bytes) 41.79 s growing 2 -> 4, 21.08 s shrinking 4 -> 2; tiny-gpt (next to no state)
# 6.84 s and 3.44 s: the fixed part (new processes, imports, world and DCP set-up).
ONLINE_BASE_SECONDS = 0.22
ONLINE_BYTES_PER_SECOND = 1.2e9
RESTART_GROW_SECONDS = 41.79
RESTART_SHRINK_SECONDS = 21.08
RESTART_GROW_FIXED_SECONDS = 6.84
RESTART_SHRINK_FIXED_SECONDS = 3.44
RESTART_REFERENCE_STATE_BYTES = 1.74e9


@dataclass(frozen=True, slots=True)
class SizeOption:
    """One GPU count a job may run on: the layout the resize ranking picks for it, its
    predicted step time (None: no measurement to scale yet), the GPUs that must share a node
    (the layout's tensor-parallel block) and the model state each GPU holds."""

    gpus: int
    layout: str
    step_seconds: float | None = None
    block: int = 1
    state_bytes_per_gpu: int = 0

    def __post_init__(self) -> None:
        require(self.gpus >= 1, f"a size option needs gpus >= 1, got {self.gpus}")
        require(self.block >= 1 and self.gpus % self.block == 0,
                f"block={self.block} must divide gpus={self.gpus} ({self.layout})")
        require(self.step_seconds is None or self.step_seconds > 0, f"step_seconds={self.step_seconds} must be > 0")


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    gpus: int           # healthy GPUs on the node
    joined_at: float = 0.0

    def __post_init__(self) -> None:
        require(self.gpus >= 0, f"node {self.name} has gpus={self.gpus} < 0")


@dataclass(frozen=True, slots=True)
class ElasticJob:
    """A job as the scheduler sees it. `holding`: the node of each rank, in rank order
    (empty: a pending arrival, which starts on `gpus` when rigid, or on any option in
    [min_gpus, max_gpus] when elastic). `busy`: starting, switching or stopping: left alone."""

    id: int
    name: str
    gpus: int
    priority: int = 0
    elastic: bool = False
    min_gpus: int = 1
    max_gpus: int = 1
    holding: tuple[str, ...] = ()
    options: tuple[SizeOption, ...] = ()
    busy: bool = False
    step_seconds: float | None = None      # measured at the current size
    remaining_steps: int | None = None     # None: trains until stopped
    last_resize_at: float | None = None    # the last start or resize
    failed_resizes: int = 0                # consecutive failed resizes
    last_failure_at: float | None = None

    def __post_init__(self) -> None:
        require(self.gpus >= 1, f"job {self.name}: gpus={self.gpus} must be >= 1")
        require(1 <= self.min_gpus <= self.max_gpus,
                f"job {self.name}: needs 1 <= min_gpus ({self.min_gpus}) <= max_gpus ({self.max_gpus})")
        require(not self.holding or len(self.holding) == self.gpus,
                f"job {self.name}: holds {len(self.holding)} GPUs but runs on gpus={self.gpus}")
        require(len({o.gpus for o in self.options}) == len(self.options), f"job {self.name}: one option per size")
        require(self.failed_resizes >= 0, f"job {self.name}: failed_resizes={self.failed_resizes} < 0")

    @property
    def running(self) -> bool:
        return bool(self.holding)

    @property
    def current(self) -> int:
        """GPUs held now (0: pending)."""
        return len(self.holding)

    def option(self, gpus: int) -> SizeOption | None:
        return next((o for o in self.options if o.gpus == gpus), None)


class PauseModel(Protocol):
    def pause_seconds(self, job: ElasticJob, dst: SizeOption) -> float:
        """Seconds the job stops training to move from its current size to `dst`."""


@dataclass(frozen=True, slots=True)
class OnlinePause:
    """The online switch: a fixed cost, plus (growing) each joining rank receiving its state
    in parallel with the others at `bytes_per_second`."""

    base_seconds: float = ONLINE_BASE_SECONDS
    bytes_per_second: float = ONLINE_BYTES_PER_SECOND

    def pause_seconds(self, job: ElasticJob, dst: SizeOption) -> float:
        if dst.gpus <= job.current:
            return self.base_seconds
        return self.base_seconds + dst.state_bytes_per_gpu / self.bytes_per_second


@dataclass(frozen=True, slots=True)
class RestartPause:
    """Stop-checkpoint-restart: a fixed part plus a part proportional to the model state each
    GPU saves and loads, both fitted to the two measured models (tiny-gpt: the fixed part;
    llama-124m: fixed + 1.74 GB per GPU). A grow restarts more processes than a shrink."""

    grow_seconds: float = RESTART_GROW_SECONDS
    shrink_seconds: float = RESTART_SHRINK_SECONDS
    grow_fixed_seconds: float = RESTART_GROW_FIXED_SECONDS
    shrink_fixed_seconds: float = RESTART_SHRINK_FIXED_SECONDS
    reference_state_bytes: float = RESTART_REFERENCE_STATE_BYTES

    def pause_seconds(self, job: ElasticJob, dst: SizeOption) -> float:
        grow = dst.gpus > job.current
        fixed = self.grow_fixed_seconds if grow else self.shrink_fixed_seconds
        measured = self.grow_seconds if grow else self.shrink_seconds
        return fixed + (measured - fixed) * dst.state_bytes_per_gpu / self.reference_state_bytes


@dataclass(frozen=True, slots=True)
class ElasticSettings:
    """`min_interval_seconds`: no job is resized twice within it (a start counts);
    a failed resize waits `backoff_seconds` x 2^(failures - 1), at most `backoff_max_seconds`;
    a grow must pay for its pause within `grow_horizon_seconds` of training."""

    min_interval_seconds: float = 300.0
    backoff_seconds: float = 60.0
    backoff_max_seconds: float = 3600.0
    grow_horizon_seconds: float = 3600.0
    pause: PauseModel = field(default_factory=OnlinePause)

    def __post_init__(self) -> None:
        for name in ("min_interval_seconds", "backoff_seconds", "backoff_max_seconds", "grow_horizon_seconds"):
            require(getattr(self, name) >= 0, f"{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True, slots=True)
class EndedJob:
    """A job that stopped or failed at `ended_at`, giving its GPUs back: a grow after it
    says so in its reason ("job 'eval' (priority 10) ended")."""

    name: str
    priority: int
    ended_at: float


@dataclass(frozen=True, slots=True)
class Change:
    """One job's new allocation: `holding` is the node of each rank after it (rank order)."""

    job_id: int
    job: str
    kind: str                 # "start", "grow" or "shrink"
    gpus_from: int
    gpus_to: int
    layout: str
    holding: tuple[str, ...]
    reason: str
    step_seconds: float | None = None   # predicted on the new size
    pause_seconds: float = 0.0
    gain_seconds: float = 0.0            # training time saved within the horizon (grows)


@dataclass(frozen=True, slots=True)
class Decision:
    changes: tuple[Change, ...]
    waiting: tuple[tuple[int, str], ...]   # (job id, why it does not start yet)

    def change_of(self, job_id: int) -> Change | None:
        return next((c for c in self.changes if c.job_id == job_id), None)
