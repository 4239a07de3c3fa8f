"""The elastic scheduler (parallelism/layout/elastic_policy.py): hypothesis properties on random
clusters and jobs, and a brute-force oracle for the priority-optimality of its counts."""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallelism.layout.elastic_inputs import (Decision, ElasticJob, ElasticSettings, EndedJob, Node, OnlinePause,
                                          RestartPause, SizeOption)
from parallelism.layout.elastic_policy import decide
from parallelism.layout.elastic_sizes import allowed_sizes, backoff_until
from parallelism.layout.errors import LayoutError

NOW = 10_000.0
SETTINGS = ElasticSettings(min_interval_seconds=300, backoff_seconds=60, backoff_max_seconds=600,
                           grow_horizon_seconds=600, pause=OnlinePause())


@st.composite
def states(draw, *, max_nodes=4, max_gpus_per_node=4, max_jobs=5, blocks=(1, 2), max_size=8):
    """(nodes, jobs): consistent holdings, random ranges, priorities, options and timers."""
    nodes = [Node(f"n{i}", draw(st.integers(1, max_gpus_per_node)), joined_at=draw(st.sampled_from([0.0, NOW - 10])))
             for i in range(draw(st.integers(1, max_nodes)))]
    slots = [n.name for n in nodes for _ in range(n.gpus)]
    jobs = []
    for job_id in range(1, draw(st.integers(0, max_jobs)) + 1):
        block = draw(st.sampled_from(blocks))
        base = draw(st.floats(0.5, 4.0))
        sizes = draw(st.sets(st.sampled_from([s for s in range(block, max_size + 1, block)]), min_size=1, max_size=4))
        measured = draw(st.booleans())
        state_bytes = draw(st.sampled_from([0, 10**8, 10**10]))
        options = tuple(SizeOption(s, f"dp={s}", base / s if measured else None, block, state_bytes) for s in sorted(sizes))
        lo, hi = sorted(draw(st.tuples(st.sampled_from(sorted(sizes)), st.sampled_from(sorted(sizes)))))
        elastic = draw(st.booleans())
        running = draw(st.booleans())
        gpus = draw(st.sampled_from(sorted(sizes)))
        holding: tuple[str, ...] = ()
        if running:
            if gpus > len(slots):
                continue
            picked = draw(st.permutations(range(len(slots))))[:gpus]
            holding = tuple(slots[i] for i in sorted(picked))
            slots = [s for i, s in enumerate(slots) if i not in set(picked)]
        resized = draw(st.sampled_from([None, NOW - 1000, NOW - 100]))
        failures = draw(st.integers(0, 2))
        jobs.append(ElasticJob(
            id=job_id, name=f"j{job_id}", gpus=gpus, priority=draw(st.integers(0, 2)), elastic=elastic,
            min_gpus=lo if elastic else gpus, max_gpus=hi if elastic else gpus, holding=holding, options=options,
            busy=draw(st.booleans()) and draw(st.booleans()), step_seconds=base / gpus if measured and running else None,
            remaining_steps=draw(st.sampled_from([None, 10, 10_000])), last_resize_at=resized,
            failed_resizes=failures, last_failure_at=NOW - draw(st.sampled_from([30, 1000])) if failures else None))
    return nodes, jobs


def apply(jobs: list[ElasticJob], decision: Decision, now: float) -> list[ElasticJob]:
    out = []
    for job in jobs:
        change = decision.change_of(job.id)
        if change is None:
            out.append(job)
            continue
        option = job.option(change.gpus_to)
        out.append(dataclasses.replace(job, holding=change.holding, gpus=change.gpus_to, last_resize_at=now,
                                       step_seconds=option.step_seconds if option else None))
    return out


def held(jobs: list[ElasticJob]) -> Counter:
    return Counter(node for job in jobs for node in job.holding)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
def test_a_decision_never_over_allocates_and_moves_ranks_only_at_the_end(state) -> None:
    nodes, jobs = state
    decision = decide(nodes, jobs, SETTINGS, NOW)
    after = apply(jobs, decision, NOW)
    capacity = {n.name: n.gpus for n in nodes}
    assert all(count <= capacity[node] for node, count in held(after).items())
    assert sum(held(after).values()) <= sum(capacity.values())
    for change in decision.changes:
        job = next(j for j in jobs if j.id == change.job_id)
        assert len(change.holding) == change.gpus_to
        keep = min(job.current, change.gpus_to)
        assert change.holding[:keep] == job.holding[:keep]  # ranks keep their GPUs; shrinks drop the last ones
        option = job.option(change.gpus_to)
        block = option.block if option else 1
        for first in range(0, change.gpus_to, block):
            if first + block > job.current:  # a block with joining ranks sits on one node
                assert len(set(change.holding[first:first + block])) == 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
def test_ranges_dampening_and_backoff_are_respected(state) -> None:
    nodes, jobs = state
    decision = decide(nodes, jobs, SETTINGS, NOW)
    for job in jobs:
        change = decision.change_of(job.id)
        if change is None:
            continue
        assert not job.busy
        if not job.running:
            assert change.kind == "start"
            if job.elastic:
                assert job.min_gpus <= change.gpus_to <= job.max_gpus
            else:
                assert change.gpus_to == job.gpus
            continue
        assert job.elastic
        assert job.last_resize_at is None or NOW - job.last_resize_at >= SETTINGS.min_interval_seconds
        until = backoff_until(job, SETTINGS)
        assert until is None or NOW >= until
        if change.gpus_to < job.current:
            assert change.gpus_to >= job.min_gpus, "never below the minimum"
            assert change.reason.startswith(f"shrank to {change.gpus_to}")
        else:
            assert change.gpus_to <= job.max_gpus
            if job.current >= job.min_gpus:
                assert change.gain_seconds > change.pause_seconds, "a grow pays for its pause within the horizon"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
def test_applying_a_decision_and_deciding_again_changes_nothing(state) -> None:
    nodes, jobs = state
    after = apply(jobs, decide(nodes, jobs, SETTINGS, NOW), NOW)
    assert decide(nodes, after, SETTINGS, NOW).changes == ()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
def test_decisions_settle_without_oscillating_as_time_goes_on(state) -> None:
    """Nothing else changing, repeated decisions (each after the interval) reach a fixed
    point, and no job goes back to a size it left."""
    nodes, jobs = state
    seen = {j.id: [j.current] for j in jobs}
    now = NOW
    for _ in range(2 * len(jobs) + 2):
        decision = decide(nodes, jobs, SETTINGS, now)
        if not decision.changes:
            break
        jobs = apply(jobs, decision, now)
        for change in decision.changes:
            assert change.gpus_to not in seen[change.job_id], f"job {change.job} came back to {change.gpus_to}"
            seen[change.job_id].append(change.gpus_to)
        now += SETTINGS.min_interval_seconds + SETTINGS.backoff_max_seconds
    else:
        pytest.fail("no fixed point")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states(blocks=(1,)))
def test_no_higher_priority_job_is_left_short_for_a_lower_one(state) -> None:
    """With blocks of 1 GPU: a job below a size it was allowed could not have reached it
    with the free GPUs plus what lower-priority jobs hold above their floors (unless a
    higher priority's arrival waits: then the free GPUs are held for it)."""
    nodes, jobs = state
    decision = decide(nodes, jobs, SETTINGS, NOW)
    after = {j.id: j.current for j in apply(jobs, decision, NOW)}
    allowed = {j.id: allowed_sizes(j, SETTINGS, NOW) for j in jobs}
    free = sum(n.gpus for n in nodes) - sum(after.values())
    waiting = [j for j in jobs if not j.running and after[j.id] == 0 and any(allowed[j.id])]
    for job in jobs:
        if any(w.priority > job.priority for w in waiting) and not job.running:
            assert after[job.id] == 0, "no lower arrival starts past a waiting one"
            continue
        spare = free + sum(after[k.id] - min(allowed[k.id]) for k in jobs if k.priority < job.priority)
        assert not [s for s in allowed[job.id] if after[job.id] < s <= after[job.id] + spare], job


def level_vector(jobs: list[ElasticJob], allowed: dict[int, list[int]], got: dict[int, int]) -> tuple | None:
    """(GPUs of the highest priority, -arrivals it leaves waiting, -jobs it changes, the same
    for the next priority, ...); None when a lower priority starts a job while a higher
    one's arrival waits (no backfill past it)."""
    vector: list[int] = []
    blocked = False
    for p in sorted({j.priority for j in jobs}, reverse=True):
        members = [j for j in jobs if j.priority == p]
        if blocked and any(got[j.id] and not j.running for j in members):
            return None
        waiting = sum(not j.running and got[j.id] == 0 and any(allowed[j.id]) for j in members)
        vector += [sum(got[j.id] for j in members), -waiting, -sum(got[j.id] != j.current for j in members)]
        blocked = blocked or waiting > 0
    return tuple(vector)


def oracle_vector(jobs: list[ElasticJob], total: int) -> tuple:
    """Brute force: the best level_vector over every combination of allowed sizes that fits."""
    allowed = {j.id: allowed_sizes(j, SETTINGS, NOW) for j in jobs}
    vectors = [level_vector(jobs, allowed, dict(zip(allowed, combo)))
               for combo in itertools.product(*allowed.values()) if sum(combo) <= total]
    return max(v for v in vectors if v is not None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states(max_nodes=3, max_jobs=4, blocks=(1,), max_size=6))
def test_the_counts_are_what_a_brute_force_search_finds_best(state) -> None:
    nodes, jobs = state
    decision = decide(nodes, jobs, SETTINGS, NOW)
    after = {j.id: j.current for j in apply(jobs, decision, NOW)}
    allowed = {j.id: allowed_sizes(j, SETTINGS, NOW) for j in jobs}
    assert level_vector(jobs, allowed, after) == oracle_vector(jobs, sum(n.gpus for n in nodes))



def placeable(nodes: list[Node], jobs: list[ElasticJob], got: dict[int, int]) -> bool:
    """Brute force: some node for every joining block (whole blocks on one node, a block the
    current ranks started finished on its last rank's node), any order, any node."""
    free = Counter({n.name: n.gpus for n in nodes})
    free.subtract(node for job in jobs for node in job.holding[:got[job.id]])
    blocks = []
    for job in jobs:
        if got[job.id] > job.current:
            block = job.option(got[job.id]).block
            rest = min(-job.current % block, got[job.id] - job.current) if job.holding else 0
            if rest:
                free[job.holding[-1]] -= rest
            blocks += [block] * ((got[job.id] - job.current - rest) // block)
    if any(v < 0 for v in free.values()):
        return False

    def fit(i: int, left: tuple[int, ...]) -> bool:
        return i == len(blocks) or any(
            room >= blocks[i] and fit(i + 1, left[:n] + (room - blocks[i],) + left[n + 1:])
            for n, room in enumerate(left))
    return fit(0, tuple(free[n.name] for n in nodes))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states(max_nodes=3, max_jobs=4, blocks=(1, 2, 4), max_size=8))
def test_the_decision_is_the_best_that_a_brute_force_placement_can_place(state) -> None:
    """With tensor-parallel blocks: the decision's counts are the best (level_vector) of all
    the combinations that fit the GPUs and whose blocks some assignment to nodes can place,
    so deciding again cannot find a better packing the first decision missed."""
    nodes, jobs = state
    decision = decide(nodes, jobs, SETTINGS, NOW)
    after = {j.id: j.current for j in apply(jobs, decision, NOW)}
    allowed = {j.id: allowed_sizes(j, SETTINGS, NOW) for j in jobs}
    total = sum(n.gpus for n in nodes)
    vectors = [level_vector(jobs, allowed, got) for got in (dict(zip(allowed, c)) for c in
               itertools.product(*allowed.values())) if sum(got.values()) <= total and placeable(nodes, jobs, got)]
    assert level_vector(jobs, allowed, after) == max(v for v in vectors if v is not None)


def elastic(job_id, name, holding, *, priority=0, lo=2, hi=8, **kw) -> ElasticJob:
    options = tuple(SizeOption(g, f"dp={g}", 1.6 / g, 1, 10**9) for g in (1, 2, 4, 8))
    return ElasticJob(id=job_id, name=name, gpus=len(holding), priority=priority, elastic=True, min_gpus=lo,
                      max_gpus=hi, holding=holding, options=options, step_seconds=1.6 / len(holding), **kw)


def test_hand_off_a_priority_job_borrows_gpus_and_they_come_back_when_it_ends() -> None:
    """Two elastic jobs and one priority job on 4 nodes x 2 GPUs (issue 31's stack scenario)."""
    nodes = [Node(f"node-{i}", 2) for i in range(1, 5)]
    a = elastic(1, "a", ("node-1",) * 2 + ("node-2",) * 2)
    b = elastic(2, "b", ("node-3",) * 2 + ("node-4",) * 2)
    evaluation = ElasticJob(id=3, name="eval", gpus=4, priority=10, options=(SizeOption(4, "dp=4"),))
    first = decide(nodes, [a, b, evaluation], SETTINGS, NOW)
    assert {c.job: c.gpus_to for c in first.changes} == {"eval": 4, "a": 2, "b": 2}
    assert first.change_of(1).reason == "shrank to 2 (dp=2): job 'eval' (priority 10) needed 4 GPUs"
    after = apply([a, b, evaluation], first, NOW)
    later = NOW + 3600
    back = decide(nodes, [j for j in after if j.name != "eval"], SETTINGS, later)
    assert {c.job: c.gpus_to for c in back.changes} == {"a": 4, "b": 4}
    assert back.change_of(1).reason.startswith("grew to 4 (dp=4): 2 GPUs free; pays its 1.1 s pause back (300 s saved")


def test_a_grow_after_a_job_ended_names_it_and_an_older_end_is_not_the_cause() -> None:
    nodes = [Node(f"node-{i}", 2) for i in range(1, 3)]
    job = elastic(1, "train", ("node-1",) * 2, lo=2, hi=4, last_resize_at=NOW - 400)
    ended = [EndedJob("eval", 10, NOW - 30), EndedJob("old", 0, NOW - 500)]
    change = decide(nodes, [job], SETTINGS, NOW, ended).change_of(1)
    assert change.reason.startswith("grew to 4 (dp=4): job 'eval' (priority 10) ended; pays its")
    assert decide(nodes, [job], SETTINGS, NOW, ended[1:]).change_of(1).reason.startswith("grew to 4 (dp=4): 2 GPUs free")
    assert [(c.gpus_to, c.holding) for c in decide(nodes, [job], SETTINGS, NOW, ended).changes] == \
        [(c.gpus_to, c.holding) for c in decide(nodes, [job], SETTINGS, NOW).changes]  # reasons only


def test_a_grow_onto_a_new_node_says_the_node_joined_and_a_restart_pause_can_make_it_not_pay() -> None:
    nodes = [Node("node-1", 2), Node("node-2", 2), Node("node-3", 4, joined_at=NOW - 5)]
    job = elastic(1, "train", ("node-1",) * 2 + ("node-2",) * 2, remaining_steps=100, last_resize_at=NOW - 400)
    online = decide(nodes, [job], SETTINGS, NOW)
    assert online.change_of(1).reason.startswith("grew to 8 (dp=8): node-3 joined; pays its 1.1 s pause back")
    restart = dataclasses.replace(SETTINGS, pause=RestartPause())
    assert decide(nodes, [job], restart, NOW).changes == ()  # 100 steps x 0.2 s saved < the 26.9 s restart


def test_a_pending_job_that_cannot_fit_waits_and_says_why() -> None:
    nodes = [Node("node-1", 2)]
    job = ElasticJob(id=1, name="big", gpus=4, options=(SizeOption(4, "dp=4"),))
    assert decide(nodes, [job], SETTINGS, NOW).waiting == ((1, "waiting: needs 4 GPUs at priority 0; 2 free after "
                                                              "this decision"),)


def test_a_tensor_parallel_block_that_finds_no_node_caps_the_job() -> None:
    """3 free GPUs but spread 1 + 2: a tp=2 grow to 4 fits one block, not two; the job takes 2 more."""
    nodes = [Node("n1", 2), Node("n2", 2), Node("n3", 2)]
    options = tuple(SizeOption(g, f"tp=2,dp={g // 2}", 1.0 / g, 2) for g in (2, 4, 6))
    other = ElasticJob(id=2, name="rigid", gpus=1, holding=("n1",), options=(SizeOption(1, "dp=1"),))
    job = ElasticJob(id=1, name="tp", gpus=2, elastic=True, min_gpus=2, max_gpus=6, holding=("n2", "n2"),
                     options=options, step_seconds=0.5)
    change = decide(nodes, [job, other], SETTINGS, NOW).change_of(1)
    assert change.gpus_to == 4 and change.holding == ("n2", "n2", "n3", "n3")



def test_a_start_that_fits_only_if_a_job_of_its_level_shrinks_gets_that_packing_at_once() -> None:
    """7 GPUs (1 + 3 + 3). j1 holds 3 (n0, n1, n1) but may shrink to 1; j2 needs 4 in tp=2
    blocks; j3 needs 1. The most GPUs (j1 3 + j2 4) cannot place j2's blocks; the next best
    (j1 1, j2 4, j3 1) can: the decision takes it, not j3 alone now and the rest a decision
    later (hypothesis found that: deciding again changed something)."""
    nodes = [Node("n0", 1), Node("n1", 3), Node("n2", 3)]
    j1 = ElasticJob(id=1, name="j1", gpus=3, elastic=True, min_gpus=1, max_gpus=1, holding=("n0", "n1", "n1"),
                    options=tuple(SizeOption(g, f"dp={g}") for g in (1, 2, 3)))
    j2 = ElasticJob(id=2, name="j2", gpus=4, options=(SizeOption(4, "tp=2,dp=2", block=2),))
    j3 = ElasticJob(id=3, name="j3", gpus=1, options=(SizeOption(1, "dp=1"),))
    decision = decide(nodes, [j1, j2, j3], SETTINGS, NOW)
    assert {c.job: (c.gpus_to, c.holding) for c in decision.changes} == {
        "j1": (1, ("n0",)), "j2": (4, ("n1", "n1", "n2", "n2")), "j3": (1, ("n1",))}
    assert decide(nodes, apply([j1, j2, j3], decision, NOW), SETTINGS, NOW).changes == ()


def test_the_largest_blocks_are_placed_first() -> None:
    """n0 1 GPU, n1 2: a 1-GPU job placed first on the emptier node would leave no node for
    the other job's 2-GPU block; both start."""
    nodes = [Node("n0", 1), Node("n1", 2)]
    small = ElasticJob(id=1, name="small", gpus=1, options=(SizeOption(1, "dp=1"),))
    wide = ElasticJob(id=2, name="wide", gpus=2, options=(SizeOption(2, "tp=2", block=2),))
    decision = decide(nodes, [small, wide], SETTINGS, NOW)
    assert {c.job: c.holding for c in decision.changes} == {"small": ("n0",), "wide": ("n1", "n1")}


def test_a_job_whose_blocks_fit_no_node_waits_and_says_so() -> None:
    nodes = [Node("n0", 3), Node("n1", 1)]
    wide = ElasticJob(id=1, name="wide", gpus=4, priority=1, options=(SizeOption(4, "tp=4", block=4),))
    small = ElasticJob(id=2, name="small", gpus=1, options=(SizeOption(1, "dp=1"),))
    decision = decide(nodes, [wide, small], SETTINGS, NOW)
    assert decision.changes == ()  # (it still waits, first: a node with 4 GPUs may join)
    assert decision.waiting == (
        (1, "waiting: needs 4 GPUs at priority 1; its 4-GPU tensor-parallel blocks fit no node"),
        (2, "waiting: needs 1 GPUs at priority 0; job 'wide' (priority 1) waits first"))


def test_inconsistent_input_is_refused_naming_the_node() -> None:
    with pytest.raises(LayoutError, match="node 'n1' has 1 GPUs but jobs hold 2"):
        decide([Node("n1", 1)], [ElasticJob(id=1, name="x", gpus=2, holding=("n1", "n1"))], SETTINGS, NOW)


@settings(max_examples=300, deadline=None)
@given(states())
def test_allowed_sizes_keep_a_running_job_within_its_range(state) -> None:
    _, jobs = state
    for job in jobs:
        sizes = allowed_sizes(job, SETTINGS, NOW)
        assert sizes[0] == job.current
        if job.running:
            assert all(s >= job.min_gpus for s in sizes if s < job.current)
            assert all(s <= job.max_gpus for s in sizes if s > job.current)


def test_a_priority_job_that_would_need_a_job_below_its_minimum_waits() -> None:
    """eval needs 7 of 8 GPUs; the elastic job can give 2 (4 -> min 2), not 3: eval waits, and
    the elastic job takes the free GPUs meanwhile."""
    nodes = [Node("n1", 8)]
    job = elastic(1, "train", ("n1",) * 4)
    big = ElasticJob(id=2, name="eval", gpus=7, priority=10, options=(SizeOption(7, "dp=7"),))
    decision = decide(nodes, [job, big], SETTINGS, NOW)
    assert [(c.job, c.gpus_to) for c in decision.changes] == [("train", 8)]
    assert decision.waiting[0][0] == 2


def test_the_pause_models_give_back_the_measured_pauses() -> None:
    """docs/benchmarks.md: llama-124m (1.74 GB per GPU) 1.46 s online grow 2 -> 4, restart
    41.79 s / 21.08 s; tiny-gpt's restart (no state to speak of) 6.84 s / 3.44 s."""
    job = elastic(1, "llama-124m", ("n1",) * 2)
    grow, shrink = SizeOption(4, "dp=4", state_bytes_per_gpu=int(1.5e9)), SizeOption(1, "dp=1")
    assert OnlinePause().pause_seconds(job, grow) == pytest.approx(1.47, abs=0.01)
    big = dataclasses.replace(grow, state_bytes_per_gpu=int(1.74e9))
    assert RestartPause().pause_seconds(job, big) == pytest.approx(41.79)
    assert RestartPause().pause_seconds(job, dataclasses.replace(shrink, state_bytes_per_gpu=int(1.74e9))) == \
        pytest.approx(21.08)
    assert (RestartPause().pause_seconds(job, dataclasses.replace(grow, state_bytes_per_gpu=0)),
            RestartPause().pause_seconds(job, shrink)) == (6.84, 3.44)


def test_while_a_priority_arrival_waits_no_lower_job_starts_on_the_gpus_it_gathers() -> None:
    """eval needs 6 of 8 GPUs, a rigid job holds 4: eval waits for it; the 4 free GPUs are
    not given to a lower arrival (that would hold them until it ends)."""
    nodes = [Node("n1", 8)]
    rigid = ElasticJob(id=1, name="rigid", gpus=4, holding=("n1",) * 4, options=(SizeOption(4, "dp=4"),))
    small = ElasticJob(id=2, name="small", gpus=2, options=(SizeOption(2, "dp=2"),))
    big = ElasticJob(id=3, name="eval", gpus=6, priority=10, options=(SizeOption(6, "dp=6"),))
    decision = decide(nodes, [rigid, small, big], SETTINGS, NOW)
    assert decision.changes == ()
    assert decision.waiting == ((3, "waiting: needs 6 GPUs at priority 10; 4 free after this decision"),
                                (2, "waiting: needs 2 GPUs at priority 0; job 'eval' (priority 10) waits first"))
    assert [c.job for c in decide(nodes, [rigid, small], SETTINGS, NOW).changes] == ["small"]


def test_a_job_below_its_minimum_grows_back_without_the_payoff_test() -> None:
    """A node loss left it on 1 GPU (min 3, sizes 1, 2, 4): it takes 4, the smallest size
    >= 3, though nothing was measured to predict a gain; 8 would need the payoff."""
    options = tuple(SizeOption(g, f"dp={g}") for g in (1, 2, 4, 8))
    job = ElasticJob(id=1, name="lost", gpus=1, elastic=True, min_gpus=3, max_gpus=8, holding=("n1",),
                     options=options)
    change = decide([Node("n1", 8)], [job], SETTINGS, NOW).change_of(1)
    assert (change.gpus_to, change.reason) == (4, "grew to 4 (dp=4): back towards its min_gpus=3")
