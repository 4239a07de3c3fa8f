"""Which layout a job takes on N GPUs, and the batch rule every layout of a job must keep:
shared by the resize, the survivors' switch, the checkpoint restore and the preview."""
from __future__ import annotations

import dataclasses

from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import batch_dp
from parallelism.layout.spec import Layout, ModuleLayout, parse_layout
from parallelism.layout.tensors import Model
from controlplane.common.errors import InvalidInput
from controlplane.jobs.models import Job
from controlplane.jobs.services import layout_check

STAGING_BYTES = 64 * 2**20  # per rank, in a switch's plan and in its orders


def batch_error(job: Job, layout: str, dp: int) -> str | None:
    """Why the job's batch does not split over `dp` replicas of `layout` (None: it does)."""
    if job.global_batch % (job.micro_batch * dp):
        return (f"global_batch={job.global_batch} is not a multiple of micro_batch={job.micro_batch} x dp={dp} "
                f"(layout {layout})")
    return None


def layout_for_resize(job: Job, gpus: int, model: Model) -> str:
    """The layout for `gpus` GPUs: the job's layout with only dp changed, if N allows it
    (every other degree kept: tp, pp, vpp, cp, ep, zero); else its tp and pp with dp=N/(tp*pp);
    else dp=N, the job-creation rule. "Allows" means: N is a multiple of the kept degrees,
    the model's rules hold and global_batch is a multiple of micro_batch x dp. When no
    candidate passes, dp=N is returned and the caller's checks report why it fails."""
    candidates: list[str] = []
    try:
        layout = parse_layout(job.layout)
    except LayoutError:
        layout = None
    if layout is not None and not layout.is_heterogeneous and layout.modules[0].first_rank is None:
        m = layout.modules[0]
        for keep in (dict(tp=m.tp, pp=m.pp, vpp=m.vpp, cp=m.cp, ep=m.ep, zero=m.zero), dict(tp=m.tp, pp=m.pp)):
            fixed = keep["tp"] * keep["pp"] * keep.get("cp", 1)
            if gpus % fixed:
                continue
            try:
                module = dataclasses.replace(ModuleLayout(module=m.module, **keep), dp=gpus // fixed)
                candidates.append(str(Layout(modules=(module,))))
            except LayoutError:
                continue
    fallback = f"dp={gpus}"
    for text in dict.fromkeys([*candidates, fallback]):
        try:
            placement = layout_check(model=model, layout=text)
        except InvalidInput:
            continue
        if placement.world == gpus and batch_error(job, text, batch_dp(placement)) is None:
            return text
    return fallback
