"""Where an elastic decision's ranks go (pure): joining ranks on the nodes' free GPUs, whole
tensor-parallel blocks on one node (docs/elastic.md, "The elastic policy")."""
from __future__ import annotations

from collections.abc import Sequence

from parallelism.layout.elastic_inputs import ElasticJob, Node


def fits_no_node(nodes: Sequence[Node], job: ElasticJob, sizes: list[int]) -> bool:
    """None of the job's allowed sizes fits this cluster even were it empty (its
    tensor-parallel blocks are larger than the nodes, or it needs more GPUs than there are).
    Such a job still waits (a node may join) but is not tried."""
    capacity = {n.name: n.gpus for n in nodes}
    return not any(whole_blocks(s, block_of(job, s), dict(capacity)) is not None for s in sizes if s)


def block_of(job: ElasticJob, size: int) -> int:
    """The tensor-parallel block of the job's layout at `size` (1 without a layout)."""
    option = job.option(size)
    return option.block if option else 1


def finish_block(holding: tuple[str, ...], need: int, block: int, free: dict[str, int]) -> list[str] | None:
    """Nodes for the joining ranks that finish the block the current ranks started (on the
    node of its last rank), taken from `free`; None if that node lacks them."""
    if not holding or not len(holding) % block:
        return []
    rest = min(block - len(holding) % block, need)
    if free[holding[-1]] < rest:
        return None
    free[holding[-1]] -= rest
    return [holding[-1]] * rest


def whole_blocks(need: int, block: int, free: dict[str, int]) -> list[str] | None:
    """Nodes for `need` joining ranks in whole blocks, the node with the most free GPUs first
    (ties by name), each node filled before the next, taken from `free` (changed only on
    success); None if they do not fit."""
    trial = dict(free)
    out: list[str] = []
    for node in sorted(trial, key=lambda n: (-trial[n], n)):
        while need >= block and trial[node] >= block:
            trial[node] -= block
            out += [node] * block
            need -= block
    if need:
        return None
    free.update(trial)
    return out


def place(nodes: Sequence[Node], jobs: Sequence[ElasticJob],
          counts: dict[int, int]) -> tuple[dict[int, tuple[str, ...]], tuple[int, int] | None]:
    """Holdings for the counts, or the first (job id, size) whose joining ranks find no room.
    Shrinks drop their last ranks; the blocks current ranks started are finished; then whole
    blocks are placed, the largest blocks first. With block sizes that divide one another
    (tensor-parallel sizes, powers of two) this order never fails where some placement fits:
    a block of size B on any node with room takes exactly B/b of the b-blocks that node
    could hold, wherever it goes."""
    free = {n.name: n.gpus for n in nodes}
    for node in (node for job in jobs for node in job.holding):
        free[node] -= 1
    holdings: dict[int, tuple[str, ...]] = {}
    for job in jobs:
        if counts[job.id] <= job.current:
            holdings[job.id] = job.holding[:counts[job.id]]
            for node in job.holding[counts[job.id]:]:
                free[node] += 1
    growing = sorted((j for j in jobs if counts[j.id] > j.current), key=lambda j: (-j.priority, j.id))
    blocks = {j.id: block_of(j, counts[j.id]) for j in growing}
    for job in growing:
        finished = finish_block(job.holding, counts[job.id] - job.current, blocks[job.id], free)
        if finished is None:
            return holdings, (job.id, counts[job.id])
        holdings[job.id] = job.holding + tuple(finished)
    for job in sorted(growing, key=lambda j: -blocks[j.id]):  # (stable: priority order within a size)
        added = whole_blocks(counts[job.id] - len(holdings[job.id]), blocks[job.id], free)
        if added is None:
            return holdings, (job.id, counts[job.id])
        holdings[job.id] += tuple(added)
    return holdings, None
