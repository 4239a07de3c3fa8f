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
3. The counts are placed: shrinking jobs drop their last ranks; starts and grows put their
   joining ranks on free GPUs, whole tensor-parallel blocks on one node, the largest blocks
   first, each job's on the nodes with the most free GPUs first (parallelism.layout.
   allocate's rule; place() says why the largest blocks go first). Counts
   whose blocks find no room are set aside and the next best counts are tried, in the order
   of step 2 (Lawler's k-best enumeration: the counts left are split into disjoint sets, each
   solved by the same knapsack). So a job that could only fit once a job of its level
   shrinks gets that packing now, not a worse one now and the better one a decision later.
   After MAX_SOLVES knapsacks without a placeable answer (many jobs whose blocks fragment the
   nodes), the job whose block found no node is capped below that size instead, until the
   counts fit.

Applying a decision (holdings as decided, the changed jobs' last_resize_at = now) and
deciding again at the same time changes nothing: every changed job is then inside its
interval, and no level can use more GPUs than it just did (tests/parallelism/layout/
test_elastic_policy.py).
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from parallelism.layout.elastic_inputs import Change, Decision, ElasticJob, ElasticSettings, EndedJob, Node
from parallelism.layout.elastic_placement import block_of, fits_no_node, place
from parallelism.layout.elastic_sizes import Payoff, allowed_sizes, payoff
from parallelism.layout.errors import require

NEG = -(2 ** 60)
MAX_SOLVES = 400  # knapsacks the search for placeable counts may solve (each well under a millisecond)


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


def level_sizes(level: Sequence[ElasticJob], sizes: dict[int, list[int]], budget: int,
                arrivals: frozenset[int]) -> dict[int, int] | None:
    """The sizes of one priority level's jobs that use the most GPUs within `budget`, then
    leave the fewest arrivals waiting, then change the fewest jobs; None if no choice fits.
    Ties go to each job's first listed size (its current one)."""
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
            score = size * k * k - k * int(waits(job, arrivals, size)) - int(size != job.current)
            shifted[size:] = best[:budget + 1 - size] + score
            better = shifted > new  # (from an unreachable total it stays below NEG // 2)
            new[better] = shifted[better]
            pick[better] = index
        if not (new > NEG // 2).any():
            return None
        best = np.where(new > NEG // 2, new, NEG)
        picks.append(pick)
    used = int(np.argmax(best))
    out = {}
    for job, pick in zip(reversed(level), reversed(picks)):
        size = sizes[job.id][int(pick[used])]
        out[job.id] = size
        used -= size
    return out


def waits(job: ElasticJob, arrivals: frozenset[int], size: int) -> bool:
    """A pending arrival left waiting: `arrivals` are the pending jobs with an allowed size."""
    return job.id in arrivals and size == 0


def choose_counts(jobs: Sequence[ElasticJob], sizes: dict[int, list[int]], total: int,
                  arrivals: frozenset[int]) -> dict[int, int] | None:
    """GPUs per job, priority levels served from the highest down (module docstring); None
    if the sizes cannot fit `total`. Once an arrival waits, no lower priority starts a job
    (no backfill past it)."""
    if any(not sizes[j.id] for j in jobs):
        return None
    floors = {j.id: min(sizes[j.id]) for j in jobs}
    counts: dict[int, int] = {}
    taken = 0
    blocked = False
    for priority in sorted({j.priority for j in jobs}, reverse=True):
        level = sorted((j for j in jobs if j.priority == priority), key=lambda j: j.id)
        lower = sum(floors[j.id] for j in jobs if j.priority < priority)
        allowed = {j.id: [s for s in sizes[j.id] if not blocked or j.running or s == 0] for j in level}
        budget = total - taken - lower
        chosen = level_sizes(level, allowed, budget, arrivals) if budget >= 0 else None
        if chosen is None:
            return None
        blocked = blocked or any(waits(j, arrivals, chosen[j.id]) for j in level)
        counts.update(chosen)
        taken += sum(chosen.values())
    return counts


def rank_of(jobs: Sequence[ElasticJob], arrivals: frozenset[int], counts: dict[int, int]) -> tuple[int, ...]:
    """What choose_counts maximizes, as a tuple to compare counts by: per priority level from
    the highest, (GPUs used, -arrivals left waiting, -jobs changed)."""
    out: list[int] = []
    for priority in sorted({j.priority for j in jobs}, reverse=True):
        level = [j for j in jobs if j.priority == priority]
        out += [sum(counts[j.id] for j in level), -sum(waits(j, arrivals, counts[j.id]) for j in level),
                -sum(counts[j.id] != j.current for j in level)]
    return tuple(out)


def placeable_alone(nodes: Sequence[Node], jobs: Sequence[ElasticJob],
                    sizes: dict[int, list[int]]) -> dict[int, list[int]]:
    """Each job's sizes without the grows that cannot place even with every other job at its
    smallest size (the most room it can get): no counts holding them would place, and
    leaving them to the search below would make it try them in every combination."""
    floors = {j.id: min(sizes[j.id]) for j in jobs}
    return {j.id: [s for s in sizes[j.id] if s <= j.current or place(nodes, jobs, {**floors, j.id: s})[1] is None]
            for j in jobs}


def placeable_counts(nodes: Sequence[Node], jobs: Sequence[ElasticJob], sizes: dict[int, list[int]], total: int,
                     arrivals: frozenset[int]) -> tuple[dict[int, int], dict[int, tuple[str, ...]]] | None:
    """The best counts (choose_counts' order) whose joining ranks all find room, with their
    holdings; None if MAX_SOLVES knapsacks found none. Lawler's k-best search: counts that
    do not place are removed by splitting what is left of their set into disjoint parts
    (the first j jobs as in those counts, job j+1 not), each part solved again; the best
    part's answer is tried next."""
    counts = choose_counts(jobs, sizes, total, arrivals)
    require(counts is not None, f"the jobs' current sizes cannot fit the {total} GPUs")
    heap = [(tuple(-x for x in rank_of(jobs, arrivals, counts)), 0, counts, sizes)]
    solves = 1
    while heap and solves < MAX_SOLVES:
        _, _, counts, part = heapq.heappop(heap)
        holdings, failed = place(nodes, jobs, counts)
        if failed is None:
            return counts, holdings
        order = sorted(jobs, key=lambda j: j.id != failed[0])  # the job that found no room first
        for i, job in enumerate(order):
            split = {**part, **{k.id: [counts[k.id]] for k in order[:i]},
                     job.id: [s for s in part[job.id] if s != counts[job.id]]}
            answer = choose_counts(jobs, split, total, arrivals)
            solves += 1
            if answer is not None:
                heapq.heappush(heap, (tuple(-x for x in rank_of(jobs, arrivals, answer)), solves, answer, split))
    return None


def capped_counts(nodes: Sequence[Node], jobs: Sequence[ElasticJob], sizes: dict[int, list[int]], total: int,
                  arrivals: frozenset[int]) -> tuple[dict[int, int], dict[int, tuple[str, ...]]]:
    """The fallback when the search gives up: a job whose block finds no room is capped below
    that size and the counts are chosen again (the current sizes always place)."""
    caps: dict[int, int] = {}
    while True:
        capped = {j.id: [s for s in sizes[j.id] if s == j.current or s < caps.get(j.id, s + 1)] for j in jobs}
        counts = choose_counts(jobs, capped, total, arrivals)
        holdings, failed = place(nodes, jobs, counts)
        if failed is None:
            return counts, holdings
        caps[failed[0]] = failed[1]


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
    by_id = {j.id: j for j in jobs}
    allowed = {j.id: allowed_sizes(j, settings, now) for j in jobs}
    arrivals = frozenset(j.id for j in jobs if not j.running and any(allowed[j.id]))
    never = {j.id for j in jobs if j.id in arrivals and fits_no_node(nodes, j, allowed[j.id])}
    sizes = placeable_alone(nodes, jobs, allowed)
    counts, holdings = (placeable_counts(nodes, jobs, sizes, total, arrivals)
                        or capped_counts(nodes, jobs, sizes, total, arrivals))
    by_name = {n.name: n for n in nodes}
    gainers = [(j, counts[j.id] - j.current) for j in jobs if counts[j.id] > j.current]
    givers = [(j, j.current - counts[j.id]) for j in jobs if counts[j.id] < j.current]
    changes, waiting = [], []
    free_after = total - sum(counts.values())
    for job in sorted(jobs, key=lambda j: (-j.priority, j.id)):
        new = counts[job.id]
        if new == job.current:
            if not job.running:
                smallest = min((s for s in allowed[job.id] if s), default=job.gpus)
                first = next((by_id[w] for w, _ in waiting if by_id[w].priority > job.priority), None)
                why = (f"its {block_of(job, smallest)}-GPU tensor-parallel blocks fit no node"
                       if job.id in never and smallest <= total
                       else f"job {first.name!r} (priority {first.priority}) waits first" if first else
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
