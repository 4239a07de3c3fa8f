"""Task names, queue names and message schemas shared by the control plane and the agents.

Messages are closed (unknown fields are rejected) so that a version skew between an agent
and the control plane fails loudly instead of silently dropping data.
"""
from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

CONTROL_QUEUE = "control"
# The control plane's own work (the beat's sweeps, the heartbeat intake, restores) has a queue
# of its own: a backlog of the agents' reports on `control` must never hold up node loss
# (docs/scaling.md). Every control worker takes both.
CONTROL_FLOWS_QUEUE = "control-flows"
EMULATE_QUEUE = "emulate"
NODE_QUEUE_PREFIX = "node."

# Tasks the control-plane worker runs (queue "control"; CONTROL_FLOW_TASKS on "control-flows").
CONTROL_AGENT_HEARTBEAT = "control.agent_heartbeat"
CONTROL_SWEEP_LOST_NODES = "control.sweep_lost_nodes"
CONTROL_TAKE_HEARTBEATS = "control.take_heartbeats"  # beat: the heartbeats posted to Redis (agents/liveness.py)
CONTROL_EMULATION_PROGRESS = "control.emulation_progress"
CONTROL_JOB_REPORT = "control.job_report"
CONTROL_INGEST_EVENTS = "control.ingest_events"  # a ReportBatch: rank 0's job reports, batched
CONTROL_TRANSITION_REPORT = "control.transition_report"
CONTROL_JOB_RESTORE = "control.job_restore"  # (the control plane queues it for itself)
CONTROL_SWEEP_STUCK_TRANSITIONS = "control.sweep_stuck_transitions"  # (beat)
CONTROL_SWEEP_RECONCILE = "control.sweep_reconcile"  # (beat) settle the jobs no agent runs any more
CONTROL_SWEEP_EMULATIONS = "control.sweep_emulations"  # (beat) fail the emulation runs no agent works on
CONTROL_SWEEP_ELASTIC = "control.sweep_elastic"  # (beat, and after changes) carry out the elastic scheduler's decisions
CONTROL_JOB_LOG = "control.job_log"  # a JobLogTail: the last lines of rank 0's log, when they change
CONTROL_PREFLIGHT_REPORT = "control.preflight_report"  # a PreflightReport: one node's pre-flight checks
CONTROL_SWEEP_PREFLIGHTS = "control.sweep_preflights"  # (beat) fail the pre-flights a node never answered
CONTROL_FLOW_TASKS = (CONTROL_TAKE_HEARTBEATS, CONTROL_SWEEP_LOST_NODES, CONTROL_SWEEP_STUCK_TRANSITIONS,
                      CONTROL_SWEEP_RECONCILE, CONTROL_SWEEP_EMULATIONS, CONTROL_SWEEP_ELASTIC,
                      CONTROL_SWEEP_PREFLIGHTS, CONTROL_JOB_RESTORE)
CONTROL_QUEUES = (CONTROL_FLOWS_QUEUE, CONTROL_QUEUE)


# Tasks one agent runs (queue "node.<name>").
NODE_PING = "node.ping"
NODE_JOB_START = "node.job_start"
NODE_JOB_STOP = "node.job_stop"
NODE_JOB_SWITCH = "node.job_switch"
NODE_JOB_SWITCH_CANCEL = "node.job_switch_cancel"
NODE_JOB_RECOVER = "node.job_recover"
NODE_PREFLIGHT = "node.preflight"
# Tasks any agent runs (queue "emulate").
EMULATE_RUN = "emulate.run"
EMULATE_SEARCH = "emulate.search"

# Device profiles the emulator knows (parallelism/emulator/devices.py; a test keeps them equal).
EMULATOR_DEVICES = ("a100", "h100", "h200", "b200", "cpu")
RECOMPUTE_MODES = ("none", "selective", "full")

HEARTBEAT_SECONDS = 2.0
# A training step's collectives wait at most this long for a peer by default (the control plane's
# DYNAPLANE_STEP_TIMEOUT_SECONDS): a host cut off is found by its peers within it.
STEP_TIMEOUT_SECONDS = 15.0
# How long a pre-flight's nodes wait for each other (agents/node/preflight.py) by default.
PREFLIGHT_SECONDS = 15.0
# A checkpoint folder is complete once its ranks wrote this file (agents/runtime/checkpoints.py);
# the control plane checks for it before a job resumes from the folder.
CHECKPOINT_COMPLETE_MARKER = "complete.json"
DATASET_PATH_MAX = 4096  # a dataset directory's absolute path (PATH_MAX)
PROTOCOL_VERSION = 1

RENDEZVOUS_PATTERN = r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$"  # "host:port" or "[v6]:port": where rank 0's store listens
NODE_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")

DeviceKind = Literal["cpu", "cuda"]


def validate_node_name(name: str) -> str:
    """Node names become queue names and URL parts: lowercase DNS labels only."""
    if not NODE_NAME_RE.match(name):
        raise ValueError(
            f"node name {name!r} is not a lowercase DNS label (letters, digits, '-', 1-63 chars)"
        )
    return name


def node_queue(name: str) -> str:
    """The Celery queue one agent consumes: node.<name>."""
    return NODE_QUEUE_PREFIX + validate_node_name(name)


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuReport(_Message):
    """One accelerator as the agent sees it (a real CUDA device or a virtual CPU one)."""

    index: int = Field(ge=0)
    model_name: str = Field(min_length=1, max_length=128)
    memory_bytes: int = Field(gt=0)
    uuid: str = Field(default="", max_length=128)


class RunningJob(_Message):
    """A job's rank processes alive on a node (or about to start there)."""

    job_id: int = Field(gt=0)
    ranks: tuple[Annotated[int, Field(ge=0)], ...] = Field(max_length=65536)


BYTES_MAX = 2**62  # no host has more memory than this: a bound, not a guess


class HostStats(_Message):
    """The node's host at a heartbeat: CPU utilisation over all cores since the previous
    beat (0-100; /proc/stat deltas) and memory in use (total minus available) of total."""

    cpu_percent: float = Field(ge=0, le=100, allow_inf_nan=False)
    cpu_count: int = Field(gt=0, le=1_048_576)
    memory_used_bytes: int = Field(ge=0, le=BYTES_MAX)
    memory_total_bytes: int = Field(gt=0, le=BYTES_MAX)

    @model_validator(mode="after")
    def _used_within_total(self) -> "HostStats":
        if self.memory_used_bytes > self.memory_total_bytes:
            raise ValueError(f"memory_used_bytes={self.memory_used_bytes} exceeds "
                             f"memory_total_bytes={self.memory_total_bytes}")
        return self


class AgentHeartbeat(_Message):
    """Sent by every agent every HEARTBEAT_SECONDS; carries its full inventory so that a
    control plane that lost its database relearns the cluster from heartbeats alone, and
    what the node runs (`jobs`: its live rank processes; `emulations`: the emulation runs it
    is working on), the observed state the control plane settles its records against."""

    version: Literal[1] = PROTOCOL_VERSION
    node: str
    host: str = Field(min_length=1, max_length=255)
    device: DeviceKind
    pid: int = Field(gt=0)
    started_at: datetime
    sent_at: datetime
    interval_seconds: float = Field(gt=0, le=60)
    gpus: tuple[GpuReport, ...]
    jobs: tuple[RunningJob, ...] = Field(default=(), max_length=4096)
    emulations: tuple[Annotated[int, Field(gt=0)], ...] = Field(default=(), max_length=4096)
    host_stats: HostStats | None = None  # None: the agent could not read them

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        return validate_node_name(value)

    @field_validator("gpus")
    @classmethod
    def _unique_indices(cls, value: tuple[GpuReport, ...]) -> tuple[GpuReport, ...]:
        indices = [gpu.index for gpu in value]
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate GPU indices in inventory: {sorted(indices)}")
        return value


class _EmulationSetting(_Message):
    """What an emulation or a search runs for: one stored EmulationRun's setting."""

    version: Literal[1] = PROTOCOL_VERSION
    run_id: int = Field(gt=0)
    model: str = Field(min_length=1, max_length=200)
    gpus: int = Field(gt=0)
    gpu: Literal["a100", "h100", "h200", "b200", "cpu"]
    global_batch: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    seq: int = Field(gt=0)
    recompute: Literal["none", "selective", "full"] = "none"
    gpus_per_node: int = Field(default=8, gt=0)


class EmulationOrder(_EmulationSetting):
    """Control plane -> agent (queue "emulate"): emulate one stored EmulationRun."""

    layout: str = Field(min_length=1, max_length=500)


SEARCH_TOP_MAX = 8


class SearchOrder(_EmulationSetting):
    """Control plane -> agent (queue "emulate"): rank the layouts worth emulating for one
    setting (a stored EmulationRun of kind "search"; parallelism/emulator/search_candidates.py).
    The result ({"top", "candidates", "layouts", "dropped"}) comes back as EmulationProgress."""

    top: int = Field(gt=0, le=SEARCH_TOP_MAX)


class EmulationProgress(_Message):
    """Agent -> control plane (queue "control"): where an emulation run is."""

    version: Literal[1] = PROTOCOL_VERSION
    run_id: int = Field(gt=0)
    state: Literal["running", "done", "failed"]
    message: str = Field(default="", max_length=500)
    result: dict | None = None
    error: str = Field(default="", max_length=4000)
    wall_seconds: float | None = Field(default=None, ge=0)
    agent: str = Field(default="", max_length=63)


class RankSlot(_Message):
    """One rank of a job on one of the node's GPUs (device index)."""

    rank: int = Field(ge=0)
    gpu: int = Field(ge=0)


class JobStartOrder(_Message):
    """Control plane -> agent (queue "node.<name>"): start this node's ranks of a job.

    Every node of the job gets the same order except `ranks`. The ranks join one
    torch.distributed world at `rendezvous` ("host:port", rank 0 listens there) and train
    until stopped (or `max_steps`). Rank 0 reports steps; the agent reports rank failures."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    job_name: str = Field(min_length=1, max_length=63)
    model: str = Field(min_length=1, max_length=200)
    layout: str = Field(min_length=1, max_length=500)
    world: int = Field(gt=0)
    global_batch: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    seq: int = Field(gt=0)
    rendezvous: str = Field(pattern=RENDEZVOUS_PATTERN, max_length=300)
    ranks: tuple[RankSlot, ...] = Field(min_length=1)
    max_steps: int | None = Field(default=None, gt=0)
    seed: int = 0
    report_every: int = Field(default=1, gt=0)
    timeout_seconds: float = Field(default=120.0, gt=0, le=3600)
    # How long a collective of a training step may wait (docs/hosts.md, "A host cut off"): a
    # peer silent this long is gone. Start-up, checkpoints and switches wait timeout_seconds.
    step_timeout_seconds: float = Field(default=STEP_TIMEOUT_SECONDS, gt=0, le=3600)
    # Periodic checkpoints (torch.distributed.checkpoint): every `checkpoint_interval` steps
    # (0: none) into `checkpoint_dir`, which every node of the job must see (shared storage).
    checkpoint_interval: int = Field(default=0, ge=0)
    checkpoint_dir: str = Field(default="", max_length=1000)
    # A restart after a failure: the new world loads this checkpoint (a step folder of
    # checkpoint_dir) instead of initialising the model; `restore_id` names the restore row.
    restore_from: str = Field(default="", max_length=1000)
    restore_id: int | None = Field(default=None, gt=0)
    # The dataset directory the ranks read (a registered dataset under the data root, which every
    # node of the job sees at this path); empty: synthetic tokens.
    dataset: str = Field(default="", max_length=DATASET_PATH_MAX)
    # The validation loss over `eval_batches` global batches of the dataset's held-out split after
    # every `eval_every` steps (0: never), reported with that step (JobStepped.validation_loss).
    eval_every: int = Field(default=0, ge=0)
    eval_batches: int = Field(default=4, gt=0, le=1000)
    # A Hugging Face model directory the first start loads its weights from (each rank its boxes);
    # empty: the seeded initialisation. Unused by a restore (the checkpoint has the state).
    init_from: str = Field(default="", max_length=DATASET_PATH_MAX)

    @field_validator("ranks")
    @classmethod
    def _ranks_in_world(cls, value: tuple[RankSlot, ...], info) -> tuple[RankSlot, ...]:
        world = info.data.get("world")
        ranks = [s.rank for s in value]
        if len(set(ranks)) != len(ranks) or len({s.gpu for s in value}) != len(value):
            raise ValueError(f"ranks {ranks} on GPUs {[s.gpu for s in value]}: a rank or a GPU appears twice")
        if world is not None and max(ranks) >= world:
            raise ValueError(f"rank {max(ranks)} is outside the world of {world} ranks")
        return value


class JobStopOrder(_Message):
    """Control plane -> agent: stop this node's ranks of a job at the next step boundary
    (all ranks of the job agree on the step); ranks still alive after `grace_seconds` are
    killed."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    grace_seconds: float = Field(default=30.0, gt=0, le=600)


class _JobReportBase(_Message):
    """What every job report carries: the job, the sending node, the layout the ranks train
    (empty when the sender does not know it) and the world's generation (`restore_id`: the
    restart after a failure it belongs to; None before the first)."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    node: str = Field(max_length=63)
    layout: str = Field(default="", max_length=500)
    restore_id: int | None = Field(default=None, gt=0)
    sent_at: datetime


class JobStarted(_JobReportBase):
    """Rank 0: the world is up and its first step is done."""

    kind: Literal["started"]
    step: int = Field(ge=0)


class JobStepped(_JobReportBase):
    """Rank 0, every `report_every` steps: a finished step's metrics. `loss` None: the step
    trained (its optimizer update is done on every surviving rank) but a peer was lost in the
    all-reduce that sums its loss, so nobody knows it (agents/runtime/orphan.py)."""

    kind: Literal["step"]
    step: int = Field(ge=0)
    loss: float | None = None
    step_seconds: float = Field(ge=0)
    tokens_per_second: float = Field(ge=0)
    validation_loss: float | None = None  # after this step, at a job's eval_every steps


class JobCheckpointed(_JobReportBase):
    """Rank 0: a periodic checkpoint of `step` is complete at `checkpoint_path`; `seconds`:
    how long training paused for it."""

    kind: Literal["checkpoint"]
    step: int = Field(ge=0)
    checkpoint_path: str = Field(min_length=1, max_length=1000)
    seconds: float = Field(ge=0)


class JobStopped(_JobReportBase):
    """Rank 0: every rank left cleanly after a stop order or max_steps (`step`: the last one);
    or its agent, with no step, when it killed ranks that outlasted the stop's grace period
    (`error` says so)."""

    kind: Literal["stopped"]
    step: int | None = Field(default=None, ge=0)
    error: str = Field(default="", max_length=4000)


class JobRestored(_JobReportBase):
    """Rank 0: a restarted world loaded the checkpoint of `step` from `checkpoint_path` in
    `seconds`; `verified`: the loaded state's digests equal the saved ones."""

    kind: Literal["restored"]
    step: int = Field(ge=0)
    checkpoint_path: str = Field(min_length=1, max_length=1000)
    verified: bool
    seconds: float = Field(ge=0)


class JobFailed(_JobReportBase):
    """An agent: its `ranks` died or raised; `error` says why."""

    kind: Literal["failed"]
    ranks: tuple[int, ...] = ()
    error: str = Field(default="", max_length=4000)


class JobOrphaned(_JobReportBase):
    """An agent: its `ranks` outlived their world (a peer was lost) after `step` and keep
    their state, waiting for a JobRecoverOrder; `error` says what broke."""

    kind: Literal["orphaned"]
    ranks: tuple[int, ...] = Field(min_length=1)
    step: int = Field(ge=0)
    error: str = Field(default="", max_length=4000)


# Rank 0 or an agent -> control plane (queue "control"): what a job's ranks did, one model
# per kind (a tagged union on `kind`), so a report of a kind always has that kind's fields.
JobReport = Annotated[Union[JobStarted, JobStepped, JobCheckpointed, JobStopped, JobRestored, JobFailed,
                            JobOrphaned], Field(discriminator="kind")]
JOB_REPORTS: TypeAdapter[JobReport] = TypeAdapter(JobReport)


def job_report(**fields) -> JobReport:
    """The report of `fields["kind"]`, validated (pydantic.ValidationError names the field)."""
    return JOB_REPORTS.validate_python(fields)


REPORT_BATCH_MAX = 500


class ReportBatch(_Message):
    """Rank 0 -> control plane (task control.ingest_events): one job's reports, in the order
    rank 0 made them, sent together (agents/runtime/batching.py) so that the control worker
    applies many in one transaction. `stream` names the sending reporter (one per rank-0
    process) and `batch` counts its batches from 1: the control plane applies a stream's
    batches in that order, whichever worker thread picks each up, and ignores a repeat."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    node: str = Field(max_length=63)
    stream: str = Field(min_length=1, max_length=32)
    batch: int = Field(gt=0)
    reports: tuple[JobReport, ...] = Field(min_length=1, max_length=REPORT_BATCH_MAX)
    # (first, last) batches of this stream the sender dropped before this one, past its buffer's
    # bound in a broker outage (agents/runtime/outbox.py): applied at once, the gap recorded.
    dropped: tuple[int, int] | None = None
    # how many of the stream's batches this message carries, numbered batch .. batch + covers - 1
    # (an outbox merges its backlog after an outage)
    covers: int = Field(1, ge=1)

    @field_validator("reports")
    @classmethod
    def _one_job(cls, value: tuple[JobReport, ...], info) -> tuple[JobReport, ...]:
        job_id = info.data.get("job_id")
        others = sorted({r.job_id for r in value} - {job_id})
        if job_id is not None and others:
            raise ValueError(f"a batch of job {job_id} holds reports of job(s) {others}")
        return value


class JobSwitchOrder(_Message):
    """Control plane -> every agent involved in a resize: move the job online from its
    current layout (`src_layout` over `src_world` ranks) to `layout` over `world` ranks.

    The switch runs on the union world, processes 0 .. max(src_world, world) - 1: process p
    < src_world is the job's rank p, processes from src_world up are new ones on the GPUs
    in `ranks` (this node's processes in the union world: staying, joining and leaving
    ones, `rank` = the process number). `process_of[d]` is the process that takes rank d of
    `layout` (the device map: the planner's choice of which GPU takes which rank, so that
    the fewest bytes move; parallelism/planner/rank_map.py); None keeps ranks' numbers (process
    d takes rank d). Processes that take no rank leave after handing their state over;
    rank 0 is always process 0. Joining processes start at once and get ready (imports,
    model objects, the union world's store at `rendezvous`) while the old ranks keep
    training; the switch runs at the first step boundary after all of them are ready."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    transition_id: int = Field(gt=0)
    # The job's settings, for nodes that join it (they never saw its start order).
    job_name: str = Field(min_length=1, max_length=63)
    model: str = Field(min_length=1, max_length=200)
    global_batch: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    seq: int = Field(gt=0)
    max_steps: int | None = Field(default=None, gt=0)
    seed: int = 0
    report_every: int = Field(default=1, gt=0)
    timeout_seconds: float = Field(default=120.0, gt=0, le=3600)
    # How long a collective of a training step may wait (docs/hosts.md, "A host cut off"): a
    # peer silent this long is gone. Start-up, checkpoints and switches wait timeout_seconds.
    step_timeout_seconds: float = Field(default=STEP_TIMEOUT_SECONDS, gt=0, le=3600)
    src_layout: str = Field(min_length=1, max_length=500)
    src_world: int = Field(gt=0)
    layout: str = Field(min_length=1, max_length=500)
    world: int = Field(gt=0)
    rendezvous: str = Field(pattern=RENDEZVOUS_PATTERN, max_length=300)
    ranks: tuple[RankSlot, ...] = ()
    staging_bytes: int = Field(default=64 * 2**20, gt=0)
    gpus_per_node: int = Field(default=8, gt=0)
    restore_id: int | None = Field(default=None, gt=0)  # the restore the job's running world came from
    # Periodic checkpoints (torch.distributed.checkpoint): every `checkpoint_interval` steps
    # (0: none) into `checkpoint_dir`, which every node of the job must see (shared storage).
    checkpoint_interval: int = Field(default=0, ge=0)
    checkpoint_dir: str = Field(default="", max_length=1000)
    process_of: tuple[int, ...] | None = None
    dataset: str = Field(default="", max_length=DATASET_PATH_MAX)  # as in JobStartOrder
    eval_every: int = Field(default=0, ge=0)  # as in JobStartOrder
    eval_batches: int = Field(default=4, gt=0, le=1000)

    @model_validator(mode="after")
    def _a_device_map(self) -> "JobSwitchOrder":
        check_device_map(self.process_of, self.world, max(self.src_world, self.world))
        return self

    def rank_of(self, process: int) -> int | None:
        """The rank of `layout` that `process` takes (None: it leaves the job)."""
        return device_map_rank(self.process_of, self.world, process)


def check_device_map(process_of: tuple[int, ...] | None, world: int, union: int) -> None:
    """A device map gives each of the `world` ranks its own process of the union world, and
    rank 0 process 0 (ValueError otherwise)."""
    p = process_of
    if p is not None and (len(p) != world or len(set(p)) != len(p) or min(p) < 0 or max(p) >= union or p[0] != 0):
        raise ValueError(f"process_of must give each of the {world} ranks its own process in 0..{union - 1}, "
                         f"rank 0 on process 0")


def device_map_rank(process_of: tuple[int, ...] | None, world: int, process: int) -> int | None:
    """The rank a process of the union world takes under a device map (None: it leaves)."""
    if process_of is None:
        return process if process < world else None
    return process_of.index(process) if process in process_of else None


class RankMove(_Message):
    """A surviving rank's number in its old world and in the recovered one."""

    old: int = Field(ge=0)
    new: int = Field(ge=0)


class JobRecoverOrder(_Message):
    """Control plane -> the nodes of a job's surviving ranks: ranks lost while training, the
    survivors (waiting since, with their state) form a new world without a checkpoint.

    They meet at a fresh `rendezvous` (the old store may have died with rank 0) as ranks
    0 .. union_world - 1 (`ranks`: this node's old -> new numbers; a waiting rank not listed
    exits). New ranks below `src_world` hold `src_layout` (whole data-parallel replicas,
    renumbered); the others join empty-handed. They check that they stopped at `step` with
    equal replicas, the engine switches the state onto `layout` over `world` ranks (the
    device map `process_of` says which process takes which; processes that take none
    leave), and training goes on; `restore_id` names the restore row."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    restore_id: int = Field(gt=0)
    step: int = Field(ge=0)
    rendezvous: str = Field(pattern=RENDEZVOUS_PATTERN, max_length=300)
    src_layout: str = Field(min_length=1, max_length=500)
    src_world: int = Field(gt=0)
    layout: str = Field(min_length=1, max_length=500)
    world: int = Field(gt=0)
    union_world: int = Field(gt=0)
    ranks: tuple[RankMove, ...] = Field(min_length=1)
    staging_bytes: int = Field(default=64 * 2**20, gt=0)
    gpus_per_node: int = Field(default=8, gt=0)
    process_of: tuple[int, ...] | None = None  # the device map, as in JobSwitchOrder (processes: new ranks)

    @model_validator(mode="after")
    def _a_device_map(self) -> "JobRecoverOrder":
        check_device_map(self.process_of, self.world, self.union_world)
        return self

    def rank_of(self, process: int) -> int | None:
        """The rank of `layout` that union-world process `process` takes (None: it leaves)."""
        return device_map_rank(self.process_of, self.world, process)

    @field_validator("ranks")
    @classmethod
    def _ranks_in_world(cls, value: tuple[RankMove, ...], info) -> tuple[RankMove, ...]:
        union = info.data.get("union_world")
        olds, news = [m.old for m in value], [m.new for m in value]
        if len(set(olds)) != len(olds) or len(set(news)) != len(news):
            raise ValueError(f"rank moves {[(m.old, m.new) for m in value]}: a rank appears twice")
        if union is not None and max(news) >= union:
            raise ValueError(f"new rank {max(news)} is outside the union world of {union} ranks")
        return value


class TransferProgress(_Message):
    """Where a switch's state transfer is: rounds done of `rounds`, the plan's network bytes
    of those rounds, and measured state bytes per rank (engine.progress.WaveRecorder.wave:
    the start, then per round its peak and the bytes after it). Live reports carry rank
    0's wave so far; the committed report every rank's complete one."""

    round: int = Field(ge=0)
    rounds: int = Field(ge=0)
    moved_bytes: int = Field(ge=0)
    waves: dict[int, list[int]] = Field(default_factory=dict)


class TensorCheck(_Message):
    """One logical tensor after a switch: do its states' digests match the ones before?"""

    name: str = Field(max_length=200)
    shape: list[int]
    match: bool
    mismatched: list[str] = Field(default_factory=list)  # the states whose digest changed
    digest: str = Field(default="", max_length=16)


class TransitionReport(_Message):
    """Rank 0 (or an agent, for failures) -> control plane: where a layout switch is.

    state follows the transition lifecycle: preparing (joining ranks starting), ready
    (all joined; the switch runs at the next step boundary), transferring, verifying,
    committed (the new layout trains), aborted (the old layout never left), rolled_back."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    transition_id: int = Field(gt=0)
    node: str = Field(max_length=63)
    state: Literal["preparing", "ready", "transferring", "verifying", "committed", "aborted", "rolled_back"]
    step: int | None = Field(default=None, ge=0)
    prepare_seconds: float | None = Field(default=None, ge=0)
    pause_seconds: float | None = Field(default=None, ge=0)
    transfer_seconds: float | None = Field(default=None, ge=0)
    verify_seconds: float | None = Field(default=None, ge=0)
    network_bytes: int | None = Field(default=None, ge=0)
    rounds: int | None = Field(default=None, ge=0)
    peak_bytes: int | None = Field(default=None, ge=0)
    predicted_peak_bytes: int | None = Field(default=None, ge=0)
    fingerprint: str = Field(default="", max_length=64)
    verified: bool | None = None
    error: str = Field(default="", max_length=4000)
    progress: TransferProgress | None = None
    tensors: list[TensorCheck] | None = None  # the verification per logical tensor
    # committed: where rank 0's pause went, seconds per phase in order (hand_over, kept_state,
    # union, plan, digest_before, transfer, digest_after, trainer, ...)
    phases: dict[Annotated[str, Field(max_length=32)], Annotated[float, Field(ge=0)]] | None = Field(
        default=None, max_length=16)
    sent_at: datetime


class JobSwitchCancel(_Message):
    """Control plane -> the nodes of a job: abandon a switch that has not started moving
    state (e.g. a joining node was lost). Rank 0 drops it at its next step boundary and
    the job trains on in its old layout; this node's joining ranks for it are stopped."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    transition_id: int = Field(gt=0)
    reason: str = Field(default="", max_length=2000)


# The bounds of a log tail (JobLogTail): what the agent reads, ships and the control plane
# stores and shows of one rank's log.
LOG_TAIL_LINES = 50
LOG_LINE_CHARS = 400
LOG_TAIL_BYTES = 16 * 1024  # UTF-8 bytes of all lines together


class JobLogTail(_Message):
    """Agent -> control plane (CONTROL_JOB_LOG): the last lines of rank 0's log of a job (its
    stdout and stderr), sent when they change and once more when the rank exits. Bounded:
    LOG_TAIL_LINES lines of at most LOG_LINE_CHARS characters, LOG_TAIL_BYTES in all, no
    line breaks inside a line; the agent writes its own folders as placeholders (no path
    of the node's disk leaves it)."""

    version: Literal[1] = PROTOCOL_VERSION
    job_id: int = Field(gt=0)
    node: str
    rank: int = Field(ge=0, le=65535)
    restore_id: int | None = Field(default=None, gt=0)
    lines: tuple[Annotated[str, Field(max_length=LOG_LINE_CHARS)], ...] = Field(max_length=LOG_TAIL_LINES)
    truncated: bool = Field(description="earlier lines of the log were left out")
    finished: bool = Field(default=False, description="the rank has exited: its last lines")
    sent_at: datetime

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        return validate_node_name(value)

    @field_validator("lines")
    @classmethod
    def _bounded_lines(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for i, line in enumerate(value):
            if "\n" in line or "\r" in line:
                raise ValueError(f"lines[{i}] holds a line break: one line per item")
        size = sum(len(line.encode("utf-8", "surrogatepass")) for line in value)
        if size > LOG_TAIL_BYTES:
            raise ValueError(f"lines hold {size} bytes, more than LOG_TAIL_BYTES={LOG_TAIL_BYTES}")
        return value


PREFLIGHT_CHECKS = ("storage", "data", "port", "rendezvous", "all-reduce", "shared storage")
PreflightCheckName = Literal["storage", "data", "port", "rendezvous", "all-reduce", "shared storage"]


class PreflightOrder(_Message):
    """Control plane -> each node of a start or a grow across hosts (docs/hosts.md, "Pre-flight"),
    before any rank starts: check what the ranks will need of this host, together. The first of
    `nodes` serves the rendezvous (it will run rank 0) and writes the probe file; every node joins
    a tiny gloo all-reduce of len(nodes) members there and reports a PreflightReport."""

    version: Literal[1] = PROTOCOL_VERSION
    preflight_id: int = Field(gt=0)
    job_id: int = Field(gt=0)
    job_name: str = Field(min_length=1, max_length=63)
    nodes: tuple[str, ...] = Field(min_length=1, max_length=4096)
    rendezvous: str = Field(pattern=RENDEZVOUS_PATTERN, max_length=300)
    checkpoint_dir: str = Field(default="", max_length=1000)  # written by every node, the probe read by all
    read_dirs: tuple[Annotated[str, Field(max_length=DATASET_PATH_MAX)], ...] = Field(default=(), max_length=8)
    timeout_seconds: float = Field(default=PREFLIGHT_SECONDS, gt=0, le=600)

    @field_validator("nodes")
    @classmethod
    def _node_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            validate_node_name(name)
        if len(set(value)) != len(value):
            raise ValueError("a node appears twice")
        return value


def rendezvous_host_port(rendezvous: str) -> tuple[str, int]:
    """("host", port) of a rendezvous "host:port" or "[v6]:port"."""
    host, _, port = rendezvous.rpartition(":")
    return host.strip("[]"), int(port)


class PreflightCheck(_Message):
    """One check on one node: what it found (`detail` says what failed, or what was seen)."""

    name: PreflightCheckName
    ok: bool
    detail: str = Field(default="", max_length=1000)

    @classmethod
    def of(cls, name: str, ok: bool, detail: str = "") -> "PreflightCheck":
        """The check with its detail cut to the bound (an exception's text may be long)."""
        return cls(name=name, ok=ok, detail=detail[:1000])


class PreflightReport(_Message):
    """Agent -> control plane (CONTROL_PREFLIGHT_REPORT): one node's pre-flight, every check it
    ran in order (a check it could not run because an earlier one failed is left out)."""

    version: Literal[1] = PROTOCOL_VERSION
    preflight_id: int = Field(gt=0)
    job_id: int = Field(gt=0)
    node: str
    checks: tuple[PreflightCheck, ...] = Field(max_length=len(PREFLIGHT_CHECKS))
    seconds: float = Field(ge=0)

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        return validate_node_name(value)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)
