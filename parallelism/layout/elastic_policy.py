"""The elastic scheduler (pure): cluster state and jobs in, desired allocations out, each
change with its reason (docs/elastic.md, "The elastic policy").

How it decides:
1. Each job's allowed sizes come from elastic_sizes.allowed_sizes (min/max, dampening,
   backoff, the grow payoff; a pending arrival may also stay at 0).
2. Priorities are served from the highest down. A priority level may use every GPU except
   what the higher levels took and the least the lower levels can shrink to (their
   smallest allowed size: a rigid, busy or recently resized job keeps all it holds). Within
   that budget the level takes the sizes that use the most GPUs, then leave the fewest
   arrivals waiting, then change the fewest jobs (a knapsack over the level's jobs, solved
   exactly by dynamic programming over the budget). So a higher priority is never left short
   for a lower one, a lower one gives up only what a higher one takes, and a job of the same
   priority shrinks only when that lets the level use more GPUs in all (a better packing of
   discrete sizes). While an arrival waits, no lower priority starts a job: a start holds its
   GPUs until that job ends, so GPUs that come free would be backfilled away from the
   arrival for good; an elastic grow may still take them, as they come back (a shrink) at
   the latest one interval later.
3. The counts are placed: shrinking jobs drop their last ranks; starts and grows, highest
   priority first, put their joining ranks on free GPUs, whole tensor-parallel blocks on one
   node, the node with the most free GPUs first (parallelism.layout.allocate's rule). A block that
   finds no node caps that job below the size it failed at, and the decision is made again.

Applying a decision (holdings as decided, the changed jobs' last_resize_at = now) and
deciding again at the same time changes nothing: every changed job is then inside its
interval, and no level can use more GPUs than it just did (tests/parallelism/layout/
test_elastic_policy.py).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from parallelism.layout.elastic_inputs import Change, Decision, ElasticJob, ElasticSettings, EndedJob, Node
from parallelism.layout.elastic_sizes import Payoff, allowed_sizes, payoff
from parallelism.layout.errors import require

NEG = -(2 ** 60)


def check_state(nodes: Sequence[Node], jobs: Sequence[ElasticJob]) -> None:
    """The input is consistent: unique names and ids, no node holding more than it has."""
    names = [n.name for n in nodes]
    require(len(set(names)) == len(names), f"nodes listed twice: {sorted({n for n in names if names.count(n) > 1})}")
    require(len({j.id for j in jobs}) == len(jobs), "job ids must be unique")
    capacity = {n.name: n.gpus for n in nodes}
    held = Counter(node for job in jobs for node in job.holding)
    for node, count in held.items():
        require(node in capacity, f"a job holds GPUs on node {node!r}, which is not a healthy node")
        require(count <= capacity[node], f"node {node!r} has {capacity[node]} GPUs but jobs hold {count}")


def level_sizes(level: Sequence[ElasticJob], sizes: dict[int, list[int]], budget: int) -> dict[int, int]:
    """The sizes of one priority level's jobs that use the most GPUs within `budget`, then
    leave the fewest arrivals waiting, then change the fewest jobs. Ties go to each job's
    first listed size (its current one)."""
    k = len(level) + 1
    best = np.full(budget + 1, NEG, dtype=np.int64)
    best[0] = 0
    picks = []
    for job in level:
        new = np.full(budget + 1, NEG, dtype=np.int64)
        pick = np.full(budget + 1, -1, dtype=np.int64)
        for index, size in enumerate(sizes[job.id]):
            if size > budget:
                continue
            shifted = np.full(budget + 1, NEG, dtype=np.int64)
            score = size * k * k - k * int(waits(job, sizes[job.id], size)) - int(size != job.current)
            shifted[size:] = best[:budget + 1 - size] + score
            better = shifted > new  # (from an unreachable total it stays below NEG // 2)
            new[better] = shifted[better]
            pick[better] = index
        require(bool((new > NEG // 2).any()), f"priority {level[0].priority}: its jobs cannot fit {budget} GPUs")
        best = np.where(new > NEG // 2, new, NEG)
        picks.append(pick)
    used = int(np.argmax(best))
    out = {}
    for job, pick in zip(reversed(level), reversed(picks)):
        size = sizes[job.id][int(pick[used])]
        out[job.id] = size
        used -= size
    return out


def waits(job: ElasticJob, sizes: list[int], size: int) -> bool:
    """A pending arrival left waiting: it could start (some allowed size) but gets 0."""
    return not job.running and size == 0 and any(sizes)


def choose_counts(jobs: Sequence[ElasticJob], sizes: dict[int, list[int]], total: int) -> dict[int, int]:
    """GPUs per job, priority levels served from the highest down (module docstring). Once
    an arrival waits, no lower priority starts a job (no backfill past it)."""
    floors = {j.id: min(sizes[j.id]) for j in jobs}
    counts: dict[int, int] = {}
    taken = 0
    blocked = False
    for priority in sorted({j.priority for j in jobs}, reverse=True):
        level = sorted((j for j in jobs if j.priority == priority), key=lambda j: j.id)
        lower = sum(floors[j.id] for j in jobs if j.priority < priority)
        allowed = {j.id: [s for s in sizes[j.id] if not blocked or j.running or s == 0] for j in level}
        chosen = level_sizes(level, allowed, total - taken - lower)
        blocked = blocked or any(waits(j, allowed[j.id], chosen[j.id]) for j in level)
        counts.update(chosen)
        taken += sum(chosen.values())
    return counts


def joining_nodes(holding: tuple[str, ...], need: int, block: int, free: dict[str, int]) -> list[str] | None:
    """Nodes for `need` joining ranks after `holding` (rank order), taken from `free`
    (changed only on success): a block the current ranks started is finished on the node of
    its last rank; then whole blocks, the node with the most free GPUs first (ties by name),
    each node filled before the next. None: they do not fit."""
    trial = dict(free)
    out: list[str] = []
    if holding and len(holding) % block:
        rest = min(block - len(holding) % block, need)
        if trial[holding[-1]] < rest:
            return None
        trial[holding[-1]] -= rest
        out += [holding[-1]] * rest
        need -= rest
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
    """Holdings for the counts, or the first (job id, size) whose joining ranks find no room."""
    free = {n.name: n.gpus for n in nodes}
    for node in (node for job in jobs for node in job.holding):
        free[node] -= 1
    holdings: dict[int, tuple[str, ...]] = {}
    for job in jobs:
        if counts[job.id] <= job.current:
            holdings[job.id] = job.holding[:counts[job.id]]
            for node in job.holding[counts[job.id]:]:
                free[node] += 1
    for job in sorted((j for j in jobs if counts[j.id] > j.current), key=lambda j: (-j.priority, j.id)):
        option = job.option(counts[job.id])
        added = joining_nodes(job.holding, counts[job.id] - job.current, option.block if option else 1, free)
        if added is None:
            return holdings, (job.id, counts[job.id])
        holdings[job.id] = job.holding + tuple(added)
    return holdings, None


def _names(jobs: Iterable[tuple[ElasticJob, int]], verb: str) -> str:
    parts = [f"job {j.name!r} (priority {j.priority}) {verb} {n} GPUs" for j, n in jobs]
    return ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")


def _reason(job: ElasticJob, new: int, layout: str, holding: tuple[str, ...], nodes: dict[str, Node],
            gainers: list[tuple[ElasticJob, int]], givers: list[tuple[ElasticJob, int]], settings: ElasticSettings,
            pay: Payoff | None, ended: Sequence[EndedJob]) -> str:
    where = f"{new} ({layout})" if layout else f"{new}"
    if not job.running:
        return f"started on {new} GPUs{f' ({layout})' if layout else ''}, priority {job.priority}"
    if new < job.current:
        takers = [(j, n) for j, n in gainers if j.id != job.id and j.priority >= job.priority]
        return f"shrank to {where}: {_names(takers, 'needed') or 'its GPUs are needed'}"
    if pay is None or (job.current < job.min_gpus and not pay.pays):  # (allowed_sizes: back up to the minimum)
        return f"grew to {where}: back towards its min_gpus={job.min_gpus}"
    since = job.last_resize_at if job.last_resize_at is not None else float("-inf")
    joined = sorted({n for n in holding[job.current:] if nodes[n].joined_at > since})
    lower = [(j, n) for j, n in givers if j.priority < job.priority]
    gone = [f"job {e.name!r} (priority {e.priority}) ended" for e in sorted(ended, key=lambda e: -e.ended_at)
            if e.ended_at > since]
    cause = (", ".join(f"{n} joined" for n in joined) if joined else _names(lower, "gave")
             or ", ".join(gone[:3]) or f"{new - job.current} GPUs free")
    return f"grew to {where}: {cause}; pays its {pay.pause_seconds:.1f} s pause back ({pay.gain_seconds:.0f} s " \
           f"saved within {settings.grow_horizon_seconds:.0f} s)"


def decide(nodes: Sequence[Node], jobs: Sequence[ElasticJob], settings: ElasticSettings, now: float,
           ended: Sequence[EndedJob] = ()) -> Decision:
    """The desired allocation of every job, as the changes from now (module docstring).
    `ended`: jobs that gave their GPUs back recently; only the reasons read them (a grow
    after one ended names it)."""
    check_state(nodes, jobs)
    total = sum(n.gpus for n in nodes)
    caps: dict[int, int] = {}
    while True:
        sizes = {j.id: [s for s in allowed_sizes(j, settings, now) if s == j.current or s < caps.get(j.id, s + 1)]
                 for j in jobs}
        counts = choose_counts(jobs, sizes, total)
        holdings, failed = place(nodes, jobs, counts)
        if failed is None:
            break
        caps[failed[0]] = failed[1]
    by_name = {n.name: n for n in nodes}
    by_id = {j.id: j for j in jobs}
    gainers = [(j, counts[j.id] - j.current) for j in jobs if counts[j.id] > j.current]
    givers = [(j, j.current - counts[j.id]) for j in jobs if counts[j.id] < j.current]
    changes, waiting = [], []
    free_after = total - sum(counts.values())
    for job in sorted(jobs, key=lambda j: (-j.priority, j.id)):
        new = counts[job.id]
        if new == job.current:
            if not job.running:
                smallest = min((s for s in allowed_sizes(job, settings, now) if s), default=job.gpus)
                first = next((by_id[w] for w, _ in waiting if by_id[w].priority > job.priority), None)
                why = (f"job {first.name!r} (priority {first.priority}) waits first" if first else
                       f"{free_after} free after this decision")
                waiting.append((job.id, f"waiting: needs {smallest} GPUs at priority {job.priority}; {why}"))
            continue
        option = job.option(new)
        pay = payoff(job, option, settings) if option else None
        reason = _reason(job, new, option.layout if option else "", holdings[job.id], by_name, gainers, givers,
                         settings, pay, ended)
        changes.append(Change(
            job_id=job.id, job=job.name, kind="start" if not job.running else "grow" if new > job.current else "shrink",
            gpus_from=job.current, gpus_to=new, layout=option.layout if option else "", holding=holdings[job.id],
            reason=reason, step_seconds=option.step_seconds if option else None,
            pause_seconds=pay.pause_seconds if pay and job.running else 0.0,
            gain_seconds=pay.gain_seconds if pay and job.running and new > job.current else 0.0))
    return Decision(changes=tuple(changes), waiting=tuple(waiting))
