"""Ranked layout proposals for resizing a job to N GPUs (GET /api/jobs/{id}/proposals).

Pure: a model, the job's batch and its measured step time in, ranked candidates out.
No emulator prediction is used here (an emulation run is a Celery round trip), so the
ranking is by a documented rule, RANKING_RULE, which the page shows next to the table:

1. a layout whose model state fits the GPUs' memory comes before one that does not;
2. then the lower predicted step time: the measured step time scaled by the work per
   GPU (W_old / W_new, the global batch is fixed) and by the pipeline bubble
   ((m + pp - 1) / m, m micro-batches per data-parallel rank), new over old;
3. then fewer model-parallel ranks (tp * pp: less communication inside a step);
4. then the smaller model state per GPU.

One prediction per proposal (reconcile(), docs/dashboard.md): the measured step scaled
as above when the job has measured steps on its current layout (the median of the last
few: one step is noisy), else the emulator's step for that layout when a finished
emulation of the same setting exists; with both, the emulated one and measured / emulated
are shown beside it (the emulator models the named GPU type, the ranks may run on others).

Worked example: tiny-gpt on dp=2 measured at 0.20 s/step, global_batch=12, micro_batch=1,
N=4: dp=4 -> 0.20 * 2/4 * 1 = 0.10 s; tp=1,pp=2,dp=2 -> m=6, bubble 7/6 -> 0.117 s.
Memory per GPU counts the model state (bf16 param + fp32 master, exp_avg, exp_avg_sq,
sharded as docs/contracts.md section 2 says), not activations.
"""
from __future__ import annotations

from dataclasses import dataclass


from parallelism.layout.errors import LayoutError
from parallelism.layout.job_memory import state_bytes_per_rank
from parallelism.layout.placement import Placement, place
from parallelism.layout.spec import Layout, ModuleLayout, parse_layout
from parallelism.layout.tensors import Model

RANKING_RULE = ("fits in GPU memory first, then the lower predicted step time (the measured step time "
                "scaled by work per GPU and by the pipeline bubble), then fewer model-parallel ranks "
                "(tp x pp), then less model state per GPU; no emulator prediction")
MAX_PROPOSALS = 24


@dataclass(frozen=True, slots=True)
class Proposal:
    layout: str
    world: int
    tp: int
    pp: int
    dp: int
    state_bytes_per_gpu: int
    fits: bool
    step_seconds: float | None
    tokens_per_second: float | None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _bubble(global_batch: int, micro_batch: int, dp: int, pp: int) -> float:
    micro_batches = max(global_batch // (micro_batch * dp), 1)
    return (micro_batches + pp - 1) / micro_batches


def candidate_layouts(model: Model, gpus: int, current: Layout, global_batch: int, micro_batch: int) -> list[Placement]:
    """Every tp x pp x dp = gpus layout the model, the batch and the training runtime accept
    (the current zero kept); kv heads fewer than tp are replicated (parallelism/training/kv_heads.py)."""
    if gpus < 1:
        raise LayoutError(f"gpus={gpus} must be >= 1")
    if current.is_heterogeneous or current.modules[0].first_rank is not None:
        raise LayoutError(f"proposals cover single-module layouts; the job runs {current}")
    module = current.modules[0]
    out = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if global_batch % (micro_batch * dp):
                continue
            try:
                layout = Layout(modules=(ModuleLayout(module=module.module, tp=tp, pp=pp, dp=dp, zero=module.zero),))
                out.append(place(model, layout))
            except LayoutError:
                continue  # e.g. heads not divisible by tp, fewer layers than pp stages
    return out


_STATE_BYTES: dict[tuple[Model, Layout], int] = {}


def most_state_bytes(placement: Placement) -> int:
    """The largest per-rank model state of a placement, kept per (model, layout): it depends on
    nothing else, and the elastic sweep asks for the same layouts of the same jobs every few
    seconds (73 ms a job at tiny-gpt, most of a sweep's time; benchmarks/cluster_scale.py)."""
    key = (placement.model, placement.layout)
    found = _STATE_BYTES.get(key)
    if found is None:
        found = int(state_bytes_per_rank(placement).max(initial=0))
        if len(_STATE_BYTES) >= 4096:  # (bounded: many models and layouts over a long life)
            _STATE_BYTES.clear()
        _STATE_BYTES[key] = found
    return found


def propose(model: Model, *, current_layout: str, gpus: int, global_batch: int, micro_batch: int, seq_len: int,
            capacity_bytes: int | None, step_seconds: float | None) -> list[Proposal]:
    """The layouts for `gpus` GPUs, ranked by RANKING_RULE. `step_seconds`: the job's
    recent measured step time (None: no prediction); `capacity_bytes`: the smallest GPU's
    memory (None: unknown, every layout counts as fitting)."""
    current = parse_layout(current_layout)
    old = place(model, current)
    old_module = old.layout.modules[0]
    old_bubble = _bubble(global_batch, micro_batch, old_module.dp, old_module.pp)
    proposals = []
    for placement in candidate_layouts(model, gpus, current, global_batch, micro_batch):
        m = placement.layout.modules[0]
        state = most_state_bytes(placement)
        predicted = None
        if step_seconds is not None and step_seconds > 0:
            bubble = _bubble(global_batch, micro_batch, m.dp, m.pp) / old_bubble
            predicted = step_seconds * old.world / placement.world * bubble
        proposals.append(Proposal(
            layout=str(placement.layout), world=placement.world, tp=m.tp, pp=m.pp, dp=m.dp, state_bytes_per_gpu=state,
            fits=capacity_bytes is None or state <= capacity_bytes, step_seconds=predicted,
            tokens_per_second=global_batch * seq_len / predicted if predicted else None))
    proposals.sort(key=lambda p: (not p.fits, p.step_seconds if p.step_seconds is not None else 0.0, p.tp * p.pp,
                                  p.state_bytes_per_gpu, p.layout))
    return proposals[:MAX_PROPOSALS]


def reconcile(proposal: dict, emulated: dict | None) -> dict:
    """The proposal with its one prediction (`predicted_step_seconds`), where it comes from
    (`predicted_from`: "measured" scaled, "emulated", or None) and, when a finished emulation
    of the layout exists (`emulated`: its step_seconds, ...), `measured_over_emulated`: the
    measured-and-scaled step over the emulated one.

    >>> reconcile({"step_seconds": 0.36}, {"step_seconds": 0.01})["measured_over_emulated"]
    36.0
    """
    measured = proposal["step_seconds"]
    emulated_step = emulated["step_seconds"] if emulated else None
    if measured is not None:
        predicted, source = measured, "measured"
    elif emulated_step is not None:
        predicted, source = emulated_step, "emulated"
    else:
        predicted, source = None, None
    ratio = measured / emulated_step if measured is not None and emulated_step else None
    return {**proposal, "emulated": emulated, "predicted_step_seconds": predicted, "predicted_from": source,
            "measured_over_emulated": ratio}
