"""The GPU counts an elastic job may take, each with the layout the resize proposals rank
first (proposals.RANKING_RULE) and its predicted step time: the elastic scheduler's
`options` (parallelism/layout/elastic_inputs.SizeOption). Pure: no database, no emulator.

Which counts: every count from min_gpus up to one node's GPUs, and above that whole nodes
only (multiples of gpus_per_node): a job larger than a node takes whole nodes, and ranking
every count of a 1,024-GPU range would cost a second per count for the large models. A
count no layout fits (memory, batch, heads) is left out.
"""
from __future__ import annotations

from parallelism.layout.elastic_inputs import SizeOption
from parallelism.layout.errors import LayoutError
from parallelism.layout.tensors import Model
from controlplane.jobs.proposals import propose


def candidate_sizes(min_gpus: int, max_gpus: int, gpus_per_node: int) -> list[int]:
    """min..max, above one node only multiples of it: (3, 20, 8) -> 3..8, 16."""
    return [n for n in range(min_gpus, max_gpus + 1) if n <= gpus_per_node or n % gpus_per_node == 0]


def size_options(model: Model, *, layout: str, sizes: list[int], global_batch: int, micro_batch: int, seq_len: int,
                 step_seconds: float | None, capacity_bytes: int | None) -> tuple[SizeOption, ...]:
    """One option per count in `sizes` some layout fits: the best-ranked fitting proposal.
    `layout`/`step_seconds`: the job's current layout and its measured step time (the
    proposals scale it; None: no prediction). Its block is the layout's tp (a tensor-parallel
    group sits on one node)."""
    out = []
    for gpus in sizes:
        try:
            ranked = propose(model, current_layout=layout, gpus=gpus, global_batch=global_batch,
                             micro_batch=micro_batch, seq_len=seq_len, capacity_bytes=capacity_bytes,
                             step_seconds=step_seconds)
        except LayoutError:
            continue
        best = next((p for p in ranked if p.fits), None)
        if best is not None:
            out.append(SizeOption(gpus=gpus, layout=best.layout, step_seconds=best.step_seconds, block=best.tp,
                                  state_bytes_per_gpu=best.state_bytes_per_gpu))
    return tuple(out)
