"""A new job that starts from a checkpoint (`POST /api/jobs` with `resume_from`): the
stop-checkpoint-restart path through the control plane (docs/elastic.md, "Resuming from
a checkpoint"), e.g. to restart a stopped job on another GPU count.

The checkpoint is a folder the periodic checkpoints wrote (agents/runtime/checkpoints.py:
DCP files, scalars.pt, complete.json). The new job's ranks load it in whatever layout the
job has (DCP reshards), exactly as a restore after lost ranks does: its start orders carry
`restore_from`, and a `restore` transition row, committed by the ranks' `restored` report,
records it. The job's latest checkpoint is that folder until the job writes its own.
"""
from __future__ import annotations

import json
from pathlib import Path

from django.utils import timezone

from parallelism.layout.tensors import Model
from agents.protocol import CHECKPOINT_COMPLETE_MARKER as COMPLETE
from controlplane.common import inputs
from controlplane.common.errors import InvalidInput
from controlplane.jobs.lifecycle import TransitionKind
from controlplane.jobs.models import Job, Transition


def checkpoint_info(*, path: str, model: Model) -> dict:
    """complete.json of the checkpoint at `path` ({step, layout, model, ...}); InvalidInput
    (field `resume_from`) when it is not an absolute path to a complete checkpoint of `model`."""
    if not path.startswith("/"):
        raise InvalidInput({"resume_from": [f"{path!r} is not an absolute path (every node of the job must reach "
                                             f"the checkpoint at the same path)"]})
    marker = Path(path) / COMPLETE
    try:
        meta = json.loads(marker.read_text())
    except FileNotFoundError:
        raise InvalidInput({"resume_from": [f"{path} is not a complete checkpoint (no {COMPLETE})"]}) from None
    except (OSError, ValueError) as exc:
        raise InvalidInput({"resume_from": [f"{marker} cannot be read: {exc}"]}) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "layout" not in meta:
        raise InvalidInput({"resume_from": [f"{marker} has no step and layout"]})
    wanted = model.name
    if meta.get("model") != wanted:
        raise InvalidInput({"resume_from": [f"{path} is a checkpoint of model {meta.get('model')!r}, "
                                             f"not of {wanted!r}"]})
    return meta


def is_resume(job: Job) -> bool:
    """A pending job that holds a checkpoint was created to resume from it."""
    return bool(job.checkpoint_path) and job.restore_id is None and job.step is None


def resume_row(job: Job) -> Transition:
    """The `restore` row of a resumed job's first start (job locked, placement and
    rendezvous set): its ranks load `job.checkpoint_path`; their `restored` report commits it."""
    meta = checkpoint_info(path=job.checkpoint_path, model=inputs.model_of(job.model))
    return Transition.objects.create(
        job=job, kind=TransitionKind.RESTORE, source_layout=meta["layout"], destination_layout=job.layout,
        source_world=None, destination_world=job.world_size, destination_placement=job.placement,
        rendezvous=job.rendezvous, step=job.checkpoint_step,
        reason=(f"started from checkpoint {job.checkpoint_path} (step {meta['step']}, written by {meta['layout']}) "
                f"on {job.world_size} GPUs as {job.layout}"),
        history=[{"state": "planned", "at": timezone.now().isoformat(), "reported": False}],
        verification={"checkpoint": job.checkpoint_path, "checkpoint_step": job.checkpoint_step})
