"""Training jobs, their layout history (transitions) and a compact metric store."""
from __future__ import annotations

from django.conf import settings
from django.db import models

from controlplane.jobs.lifecycle import (LIVE_JOB_STATES, TERMINAL_TRANSITION_STATES, JobState, TransitionKind,
                                        TransitionState)

DEFAULT_CHECKPOINT_INTERVAL = 100

ACTIVE_TRANSITION_STATES = sorted(s.value for s in TransitionState if s not in TERMINAL_TRANSITION_STATES)


class Job(models.Model):
    name = models.SlugField(max_length=63, unique=True)
    model = models.CharField(max_length=200, help_text="catalog name or path to a Hugging Face config.json")
    layout = models.CharField(max_length=500, help_text="current layout string (docs/contracts.md section 1)")
    world_size = models.PositiveIntegerField(help_text="GPUs the current layout spans")
    state = models.CharField(max_length=16, choices=[(s.value, s.value) for s in JobState], default=JobState.PENDING)
    global_batch = models.PositiveIntegerField(default=8)
    micro_batch = models.PositiveIntegerField(default=1)
    seq_len = models.PositiveIntegerField(default=128)
    error = models.TextField(blank=True)
    max_steps = models.PositiveIntegerField(null=True, blank=True, help_text="stop after this many steps; none: until stopped")
    placement = models.JSONField(
        default=list, blank=True,
        help_text="where the current layout's ranks run: [{rank, node, gpu}] in rank order (empty until started)")
    rendezvous = models.CharField(max_length=300, blank=True, help_text="host:port where rank 0 listens")
    rendezvous_port = models.PositiveIntegerField(null=True, blank=True)
    step = models.PositiveIntegerField(null=True, blank=True, help_text="the last step rank 0 reported")
    checkpoint_interval = models.PositiveIntegerField(
        default=DEFAULT_CHECKPOINT_INTERVAL, help_text="steps between periodic checkpoints; 0: none")
    checkpoint_dir = models.CharField(
        max_length=1000, blank=True,
        help_text="where the ranks write checkpoints; every node of the job must see it (shared storage)")
    checkpoint_step = models.PositiveIntegerField(null=True, blank=True, help_text="step of the latest checkpoint")
    checkpoint_path = models.CharField(max_length=1000, blank=True, help_text="folder of the latest checkpoint")
    checkpoint_seconds = models.FloatField(null=True, blank=True, help_text="training paused this long for it")
    checkpoint_at = models.DateTimeField(null=True, blank=True)
    restore_id = models.PositiveIntegerField(
        null=True, blank=True, help_text="the restore transition the ranks now running came from (none: first start)")
    restored_step = models.PositiveIntegerField(null=True, blank=True,
                                                help_text="checkpoint step of the latest restore")
    recovery = models.JSONField(
        default=dict, blank=True,
        help_text="while restoring: what the recovery rule decides on (restore.py): eligible (no transition was "
                  "active when ranks were lost), orphans [{rank, node, step}] (ranks that outlived their world "
                  "and wait with their state), failed_nodes (their agents killed the job's ranks there)")
    report_stream = models.CharField(max_length=32, blank=True,
                                     help_text="the rank-0 reporter whose batches the job last applied")
    report_batch = models.PositiveIntegerField(default=0, help_text="the last batch of report_stream applied")
    elastic = models.BooleanField(
        default=False, help_text="the elastic scheduler may resize the job within [min_gpus, max_gpus]; off: never")
    min_gpus = models.PositiveIntegerField(null=True, blank=True,
                                           help_text="elastic range: the fewest GPUs (null: world_size)")
    max_gpus = models.PositiveIntegerField(null=True, blank=True,
                                           help_text="elastic range: the most GPUs (null: world_size)")
    priority = models.IntegerField(default=0, help_text="a higher priority gets GPUs first, from lower ones")
    queued = models.BooleanField(
        default=False, help_text="while pending: the elastic scheduler starts it once its priority lets it "
                                 "(POST /api/jobs queue=true); false: a pending job waits for POST start")
    started_at = models.DateTimeField(null=True, blank=True,
                                      help_text="when it was last placed on GPUs (a start counts as a resize for "
                                                "the elastic scheduler's interval)")
    resize_failures = models.PositiveIntegerField(
        default=0, help_text="resizes that failed in a row (aborted, rolled back, or refused when the elastic "
                             "scheduler asked); a committed one resets it; the scheduler backs off")
    resize_failed_at = models.DateTimeField(null=True, blank=True, help_text="when the last one failed")
    dataset = models.ForeignKey(
        "datasets.Dataset", on_delete=models.PROTECT, null=True, blank=True, related_name="jobs",
        help_text="what the job trains on (the ranks read its directory under the data root); none: synthetic tokens")
    dataset_samples_per_epoch = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="samples of seq_len + 1 tokens in one epoch of the dataset's train split, "
                                         "at the job's seq_len (the dataset library's count, at creation)")
    eval_every = models.PositiveIntegerField(
        default=0, help_text="the validation loss over eval_batches global batches of the dataset's validation split "
                             "after every eval_every steps; 0: never")
    eval_batches = models.PositiveIntegerField(default=4, help_text="global batches of the validation split each "
                                                                    "evaluation reads (the same ones every time)")
    init_from = models.CharField(
        max_length=1000, blank=True,
        help_text="a Hugging Face model directory, relative to the weights root (DYNAPLANE_WEIGHTS_ROOT), whose "
                  "weights the job's first start loads; empty: the seeded initialisation")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # Two live jobs never share a rendezvous port (the scheduler also picks under lock).
            models.UniqueConstraint(fields=["rendezvous_port"], name="unique_live_rendezvous_port",
                                    condition=models.Q(state__in=sorted(s.value for s in LIVE_JOB_STATES))),
        ]

    def __str__(self) -> str:
        return f"{self.name} [{self.layout}] {self.state}"

    @property
    def gpu_range(self) -> tuple[int, int]:
        """(min_gpus, max_gpus), world_size for a bound not set."""
        return (self.min_gpus or self.world_size, self.max_gpus or self.world_size)

    @property
    def nodes(self) -> list[str]:
        """The nodes that run the current layout's ranks, in the order of their first rank."""
        return list(dict.fromkeys(slot["node"] for slot in self.placement))


class Transition(models.Model):
    """One layout switch of a job: the layout history."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="transitions")
    kind = models.CharField(max_length=16, choices=[(k.value, k.value) for k in TransitionKind],
                            default=TransitionKind.RESIZE,
                            help_text="resize: an online switch; restore: a restart from a checkpoint after a loss")
    source_layout = models.CharField(max_length=500)
    destination_layout = models.CharField(max_length=500)
    state = models.CharField(
        max_length=16, choices=[(s.value, s.value) for s in TransitionState], default=TransitionState.PLANNED
    )
    reason = models.TextField(blank=True, help_text="why it was requested, or why it aborted / rolled back")
    plan_summary = models.JSONField(default=dict, blank=True)
    plan_fingerprint = models.CharField(max_length=64, blank=True)
    source_world = models.PositiveIntegerField(null=True, blank=True, help_text="ranks of the source layout")
    destination_world = models.PositiveIntegerField(null=True, blank=True, help_text="ranks of the destination layout")
    source_placement = models.JSONField(
        default=list, blank=True, help_text="where the source layout's ranks ran: [{rank, node, gpu}] in rank order")
    destination_placement = models.JSONField(
        default=list, blank=True,
        help_text="where the destination layout's ranks run: on the GPUs of the processes the device map gives them "
                  "(a staying process keeps its GPU, joining ones get new GPUs)")
    process_of = models.JSONField(
        null=True, blank=True,
        help_text="the device map: the union-world process of each destination rank (process p < source_world is "
                  "source rank p, the others are joining); null: destination rank d on process d")
    rendezvous = models.CharField(max_length=300, blank=True, help_text="host:port of the union world's store (rank 0)")
    rendezvous_port = models.PositiveIntegerField(null=True, blank=True)
    gpus_per_node = models.PositiveIntegerField(null=True, blank=True, help_text="what the plan and the ranks assume")
    staging_bytes = models.BigIntegerField(null=True, blank=True, help_text="staging budget per rank")
    step = models.PositiveIntegerField(null=True, blank=True, help_text="the last step of the source layout")
    rounds = models.PositiveIntegerField(null=True, blank=True)
    peak_bytes = models.BigIntegerField(null=True, blank=True, help_text="measured on rank 0: state + staging")
    predicted_peak_bytes = models.BigIntegerField(null=True, blank=True, help_text="the planner's figure for rank 0")
    history = models.JSONField(
        default=list, blank=True,
        help_text="[{state, at, reported}] per state entered; reported=false: passed through, no report of it came")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    prepare_seconds = models.FloatField(null=True, blank=True)
    pause_seconds = models.FloatField(null=True, blank=True)
    transfer_seconds = models.FloatField(null=True, blank=True)
    verify_seconds = models.FloatField(null=True, blank=True)
    network_bytes = models.BigIntegerField(null=True, blank=True)
    peak_staging_bytes = models.BigIntegerField(null=True, blank=True,
                                                help_text="planned: the largest per-rank send + receive bytes")
    verification = models.JSONField(default=dict, blank=True,
                                    help_text="what rank 0 reported: verified (digests), fingerprint, matches_plan, "
                                              "tensors (per logical tensor: name, shape, match)")
    progress = models.JSONField(
        default=dict, blank=True,
        help_text="the state transfer: round (done), rounds, moved_bytes, waves {rank: measured state bytes}")

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # One active transition per job, and active transitions never share a port.
            models.UniqueConstraint(fields=["job"], name="one_active_transition_per_job",
                                    condition=models.Q(state__in=ACTIVE_TRANSITION_STATES)),
            models.UniqueConstraint(fields=["rendezvous_port"], name="unique_active_transition_port",
                                    condition=models.Q(state__in=ACTIVE_TRANSITION_STATES)),
        ]

    def __str__(self) -> str:
        return f"{self.job.name}: {self.source_layout} -> {self.destination_layout} ({self.state})"


class Preflight(models.Model):
    """A pre-flight of a start or a grow across hosts (controlplane/jobs/preflight.py): its nodes
    (the first serves the rendezvous), what each reported, and how it ended."""

    class State(models.TextChoices):
        RUNNING = "running"
        PASSED = "passed"  # the start or switch orders went out
        FAILED = "failed"  # a check failed, or a node never answered: the job stayed as it was
        CANCELLED = "cancelled"  # the job or the resize moved on (stopped, timed out) before it ended

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="preflights")
    transition = models.ForeignKey(Transition, on_delete=models.CASCADE, null=True, blank=True,
                                   related_name="preflights", help_text="the grow it checks (none: a start)")
    nodes = models.JSONField(default=list, help_text="[{node, host}] in order; the first runs rank 0")
    rendezvous = models.CharField(max_length=300)
    results = models.JSONField(default=dict, blank=True,
                               help_text="node -> {checks: [{name, ok, detail}], seconds}, as each reported")
    state = models.CharField(max_length=16, choices=State.choices, default=State.RUNNING)
    error = models.TextField(blank=True, help_text="what failed, by host and check")
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"pre-flight {self.pk} of {self.job.name}: {self.state}"


class ElasticSweep(models.Model):
    """One row (id 1): the elastic scheduler's last sweep. Sweeps lock it, so two never
    decide at once (controlplane/jobs/elastic_apply.py)."""

    ran_at = models.DateTimeField(null=True, blank=True, help_text="when the last sweep read the cluster and jobs")
    outcomes = models.JSONField(default=list, blank=True,
                                help_text="what it did with each change: [{job_id, job, kind, gpus_to, outcome, "
                                          "detail}]")

    def __str__(self) -> str:
        return f"elastic sweep at {self.ran_at}"


class MetricSeries(models.Model):
    """One time series: e.g. step_seconds of a job, or memory_bytes of rank 3 during a
    transition. Points live in MetricChunk rows of up to CHUNK_POINTS samples."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metric_series")
    transition = models.ForeignKey(Transition, on_delete=models.CASCADE, null=True, blank=True, related_name="metric_series")
    name = models.CharField(max_length=64)
    rank = models.IntegerField(null=True, blank=True)
    unit = models.CharField(max_length=16, blank=True)
    points = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            # NULL transition/rank compare unequal in SQL; metrics_series_get() is the one writer.
            models.UniqueConstraint(fields=["job", "transition", "name", "rank"], name="unique_metric_series"),
        ]

    def __str__(self) -> str:
        rank = f"[rank {self.rank}]" if self.rank is not None else ""
        return f"{self.job.name}.{self.name}{rank}"


class MetricChunk(models.Model):
    series = models.ForeignKey(MetricSeries, on_delete=models.CASCADE, related_name="chunks")
    first_point = models.PositiveIntegerField(help_text="index of this chunk's first point in the series")
    count = models.PositiveIntegerField(default=0)
    x = models.BinaryField(help_text="float64 little-endian: step or seconds")
    y = models.BinaryField(help_text="float64 little-endian: the values")

    class Meta:
        ordering = ["series", "first_point"]
        constraints = [models.UniqueConstraint(fields=["series", "first_point"], name="unique_metric_chunk")]


class JobLog(models.Model):
    """The last lines of rank 0's log of a job (stdout and stderr), as its agent last sent
    them (agents/node/log_tail.py): bounded by protocol.LOG_TAIL_LINES, LOG_LINE_CHARS and
    LOG_TAIL_BYTES, replaced whole by each newer tail."""

    job = models.OneToOneField(Job, on_delete=models.CASCADE, related_name="log")
    node = models.CharField(max_length=63)
    rank = models.PositiveIntegerField(default=0)
    restore_id = models.PositiveIntegerField(null=True, blank=True, help_text="the restart these ranks are (none: first)")
    lines = models.JSONField(default=list, help_text="oldest first")
    truncated = models.BooleanField(default=False, help_text="earlier lines of the log were left out")
    finished = models.BooleanField(default=False, help_text="the rank had exited: its last lines")
    sent_at = models.DateTimeField(help_text="when the agent read them")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.job.name}: rank {self.rank} log ({len(self.lines)} lines)"
