"""Which GPU counts one job may take in a decision (pure): the per-job half of the elastic
policy; elastic_policy chooses among these sizes across jobs.

- A pending arrival: 0 (it waits) or a start size: its `gpus` when rigid, any option in
  [min_gpus, max_gpus] when elastic. A start is not a resize: no payoff test.
- A running job that is not elastic, busy, resized within `min_interval_seconds`, or
  backing off after a failed resize: only its current size.
- Otherwise its current size; any option in [min_gpus, current) (a shrink, taken only when
  another job needs the GPUs); and any option in (current, max_gpus] whose grow pays for
  its pause within the horizon. A job below its minimum (it lost GPUs with a node) may
  grow back up to its smallest option >= min_gpus without the payoff test.

Payoff: the job saves (t_now - t_new) per step, for the steps it would train within the
horizon at its current speed (fewer when it has fewer steps left); the grow pays when that
exceeds the pause the cost model predicts. Worked example: t_now = 0.20 s, t_new = 0.10 s,
horizon 3600 s -> 18,000 steps x 0.10 s = 1,800 s saved, against a 1.5 s pause: it pays.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallelism.layout.elastic_inputs import ElasticJob, ElasticSettings, SizeOption


@dataclass(frozen=True, slots=True)
class Payoff:
    pause_seconds: float
    gain_seconds: float

    @property
    def pays(self) -> bool:
        return self.gain_seconds > self.pause_seconds


def backoff_until(job: ElasticJob, settings: ElasticSettings) -> float | None:
    """When a job whose last resizes failed may be resized again (None: no failure)."""
    if job.failed_resizes == 0 or job.last_failure_at is None:
        return None
    wait = min(settings.backoff_seconds * 2 ** (job.failed_resizes - 1), settings.backoff_max_seconds)
    return job.last_failure_at + wait


def frozen_reason(job: ElasticJob, settings: ElasticSettings, now: float) -> str | None:
    """Why a running job keeps its size whatever happens (None: it may be resized)."""
    if not job.elastic:
        return "not elastic"
    if job.busy:
        return "busy"
    if job.last_resize_at is not None and now - job.last_resize_at < settings.min_interval_seconds:
        return f"resized {now - job.last_resize_at:.0f} s ago (interval {settings.min_interval_seconds:.0f} s)"
    until = backoff_until(job, settings)
    if until is not None and now < until:
        return f"backing off after {job.failed_resizes} failed resize(s) until {until:.0f}"
    return None


def payoff(job: ElasticJob, dst: SizeOption, settings: ElasticSettings) -> Payoff:
    pause = settings.pause.pause_seconds(job, dst)
    now_step = job.step_seconds
    if now_step is None and (current := job.option(job.current)) is not None:
        now_step = current.step_seconds
    if now_step is None or dst.step_seconds is None or dst.step_seconds >= now_step:
        return Payoff(pause, 0.0)
    steps = settings.grow_horizon_seconds / now_step
    if job.remaining_steps is not None:
        steps = min(steps, job.remaining_steps)
    return Payoff(pause, (now_step - dst.step_seconds) * steps)


def allowed_sizes(job: ElasticJob, settings: ElasticSettings, now: float) -> list[int]:
    """The sizes this job may end the decision on, current first, then largest first."""
    if not job.running:
        if job.busy:
            return [0]
        if not job.elastic:
            return [0, job.gpus]
        return [0, *sorted((o.gpus for o in job.options if job.min_gpus <= o.gpus <= job.max_gpus), reverse=True)]
    current = job.current
    if frozen_reason(job, settings, now) is not None:
        return [current]
    sizes = [o.gpus for o in job.options if job.min_gpus <= o.gpus <= job.max_gpus]
    back_to_min = min(sizes, default=None) if current < job.min_gpus else None
    out = [current]
    for option in sorted(job.options, key=lambda o: -o.gpus):
        s = option.gpus
        if s == current or s > job.max_gpus:
            continue
        if s < current:
            if s >= job.min_gpus:  # a shrink never goes below the minimum
                out.append(s)
        elif (back_to_min is not None and s <= back_to_min) or payoff(job, option, settings).pays:
            out.append(s)
    return out
