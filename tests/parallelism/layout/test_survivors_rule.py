"""recovery.recovery_rule: the survivors take over only when they may, and then the source
layout they are said to form holds, on each renumbered rank, exactly the boxes that rank
held before (hypothesis, against holder_boxes); otherwise the checkpoint, otherwise fail."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.layout.recovery import CHECKPOINT, FAIL, SURVIVORS, recovery_rule
from parallelism.layout.shards import OPTIM, PARAM, holder_boxes
from parallelism.layout.survivors import uncovered
from tests.parallelism.layout.strategies import layouts, models


def _boxes(placement, rank: int) -> dict:
    out = {}
    for tensor in placement.model.tensors:
        for cls in (PARAM, OPTIM):
            h = holder_boxes(placement, tensor, cls)
            hit = np.flatnonzero(h.rank == rank)
            if len(hit):
                i = hit[0]
                out[(tensor.name, cls)] = (int(h.a0[i]), int(h.a1[i]), int(h.b0[i]), int(h.b1[i]))
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_survivors_take_over_only_when_they_hold_the_state_as_a_layout(data) -> None:
    model = data.draw(models())
    placement = place(model, data.draw(layouts(model, max_world=16)))
    alive = data.draw(st.lists(st.integers(0, placement.world - 1), unique=True))
    ml = next(iter(placement.modules.values()))
    if data.draw(st.booleans()):  # a node loss: whole replicas lost, and maybe some other ranks
        lost = set(data.draw(st.lists(st.integers(0, ml.dp - 1), unique=True)))
        alive = sorted({r for r in range(placement.world) if (r // ml.tp) % (ml.dp * ml.cp) // ml.cp not in lost}
                       - set(alive[:1]))
    step = data.draw(st.integers(0, 50))
    # Some ranks may have finished the broken step (its all-reduce completed for them): a step ahead.
    ahead = set(data.draw(st.lists(st.sampled_from(alive), unique=True))) if alive and data.draw(st.booleans()) else set()
    survivors = {r: step + (r in ahead) for r in alive}
    sources = sorted(ahead or alive)  # the ranks at the latest step: only they may hold the state
    active = data.draw(st.integers(0, 3)) == 0
    no_checkpoint = data.draw(st.sampled_from([None, "no checkpoint to restore from"]))
    got = recovery_rule(placement, survivors, transition_active=active, no_checkpoint=no_checkpoint)
    event(got.action)
    if got.action != SURVIVORS:
        assert got.world is None and got.why
        assert got.action == (CHECKPOINT if no_checkpoint is None else FAIL)
        if no_checkpoint:
            assert got.why.startswith(no_checkpoint)
        # rank = stage*tp*dp*cp + tp_rank + tp*(cp_rank + cp*dp_rank): replica d by brute force
        replica = {d: {r for r in range(ml.world) if (r // ml.tp) % (ml.dp * ml.cp) // ml.cp == d}
                   for d in range(ml.dp)}
        whole = any(members <= set(sources) for members in replica.values())
        plain = (len(placement.modules) == 1 and ml.ep == 1 and not ml.offset and ml.zero == 0
                 and not placement.layout.is_heterogeneous)
        # Every condition held: the rule must not have refused.
        assert not (plain and whole and not active and sources and not uncovered(placement, sources))
        return
    assert not active and uncovered(placement, sources) == []
    world = got.world
    olds = [old for old, _ in world.ranks]
    news = [new for _, new in world.ranks]
    assert sorted(olds) == sorted(alive) and sorted(news) == list(range(len(alive)))
    source = place(model, world.source_layout)
    assert source.world == world.source_world <= len(alive)
    for old, new in world.ranks:
        if new < world.source_world:
            assert old in sources, (old, survivors)
            assert _boxes(source, new) == _boxes(placement, old), (old, new, world.source_layout)
    # The source layout's ranks together hold every element: nothing is lost on the way.
    assert uncovered(source, range(source.world)) == []


def test_the_cases_a_node_loss_meets() -> None:
    spec = get_model("tiny-gpt")
    dp2 = place(spec, "dp=2")
    # dp=2 over two nodes, rank 0's node lost: rank 1 alone becomes rank 0 of a one-rank world.
    got = recovery_rule(dp2, {1: 7}, transition_active=False, no_checkpoint="no checkpoint to restore from")
    assert got.action == SURVIVORS and got.world.ranks == ((1, 0),) and got.world.source_world == 1
    assert place(spec, got.world.source_layout).world == 1
    # Survivors a step apart (one finished the broken step's all-reduce): the latest step's
    # replicas are the source, the rank behind joins empty-handed, the job goes on at step 8.
    dp3 = place(spec, "dp=3")
    apart = recovery_rule(dp3, {0: 7, 1: 8}, transition_active=False, no_checkpoint=None)
    assert apart.action == SURVIVORS and apart.world.ranks == ((1, 0), (0, 1)) and apart.world.source_world == 1
    # ... but not when the ranks at the latest step do not hold the state, nor during a switch, nor none at all.
    tp2 = place(spec, "tp=2,dp=2")
    assert recovery_rule(tp2, {0: 7, 1: 8}, transition_active=False, no_checkpoint=None).why == (
        "the surviving ranks stopped at different steps [7, 8], and those at step 8 (ranks [1]) no longer "
        "held every state element")
    assert recovery_rule(dp2, {1: 7}, transition_active=True, no_checkpoint=None).why == (
        "a layout switch was active when the ranks were lost")
    failed = recovery_rule(dp2, {}, transition_active=False, no_checkpoint="no checkpoint to restore from")
    assert failed.action == FAIL and failed.why == (
        "no checkpoint to restore from; the survivors could not take over: no surviving rank outlived its "
        "world (none reported waiting for a recovery order)")
    # ZeRO-1 splits the optimizer states: the checkpoint it is.
    zero = recovery_rule(place(spec, "dp=2,zero=1"), {1: 7}, transition_active=False, no_checkpoint=None)
    assert zero.action == CHECKPOINT and "no longer held every state element" in zero.why
    # tp=2,dp=3 with ranks 2, 3 lost: replicas 0 and 2 become tp=2,dp=2.
    got = recovery_rule(place(spec, "tp=2,dp=3"), {r: 4 for r in (0, 1, 4, 5)}, transition_active=False,
                        no_checkpoint=None)
    assert (got.world.source_layout, got.world.ranks) == ("tp=2,dp=2", ((0, 0), (1, 1), (4, 2), (5, 3)))
    # tp=2,dp=2 with ranks 0 and 3 alive: every element is held, but by no whole replica.
    split = recovery_rule(place(spec, "tp=2,dp=2"), {0: 4, 3: 4}, transition_active=False, no_checkpoint=None)
    assert split.action == CHECKPOINT and split.why.startswith("no whole data-parallel replica survived")
