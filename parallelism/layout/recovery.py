"""What a job does when ranks are lost while it trains (pure): go on from the survivors'
memory, restore from the latest checkpoint, or fail (docs/elastic.md, "Failures and recovery").

The survivors can take over without a checkpoint only when
- no transition was active when the ranks were lost (a switch moves state between layouts),
- the survivors that outlived their world at the latest step any of them reached (ranks
  report that step) hold every state element (survivors.uncovered), and
- some of those form whole data-parallel replicas: their state is then exactly the job's
  layout with dp = the number of whole replicas, on the replicas' ranks renumbered (what
  `survivors_source` computes). The other survivors join that world empty-handed.

Survivors may stop one step apart: a collective broken by the lost rank can complete on
some ranks (they have every contribution they need and apply the step) and not on others.
Those at the latest step hold that step's state; the ones a step behind hold an older one,
so they join without state, like any new rank, and the job goes on at the latest step.

Worked example: tp=2,dp=3 (ranks: tp_rank + 2*dp_rank), ranks 2, 3 lost. Replicas 0 and 2
are whole: old ranks 0, 1, 4, 5 become 0, 1, 2, 3 of tp=2,dp=2.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from parallelism.layout.placement import Placement
from parallelism.layout.spec import Layout, ModuleLayout
from parallelism.layout.survivors import uncovered

SURVIVORS = "survivors"
CHECKPOINT = "checkpoint"
FAIL = "fail"


@dataclass(frozen=True, slots=True)
class SurvivorWorld:
    """The survivors renumbered: `ranks` maps old -> new rank, the whole replicas first
    (new ranks 0 .. source_world - 1, holding `source_layout`), then the others."""

    source_layout: str
    source_world: int
    ranks: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Recovery:
    action: str   # SURVIVORS, CHECKPOINT or FAIL
    why: str      # why the survivors could not take over ("" when they do)
    world: SurvivorWorld | None = None


def _replica_ranks(ml: ModuleLayout, dp_rank: int) -> list[int]:
    """The ranks of one data-parallel replica (every tp, cp and pp coordinate), in rank order."""
    data = ml.dp * ml.cp
    return sorted(ml.offset + stage * ml.tp * data + tp + ml.tp * (c + ml.cp * dp_rank)
                  for stage in range(ml.pp) for c in range(ml.cp) for tp in range(ml.tp))


def survivors_source(placement: Placement, survivors: Iterable[int],
                     sources: Iterable[int] | None = None) -> SurvivorWorld | str:
    """The layout the whole replicas among `sources` (default: every survivor) form, with the
    rank map; or why there is none. The other survivors join empty-handed."""
    alive = set(survivors)
    able = alive if sources is None else set(sources) & alive
    if placement.layout.is_heterogeneous or len(placement.modules) != 1:
        return "the layout has a layout per module (only one-module layouts are renumbered)"
    ml = next(iter(placement.modules.values()))
    if ml.offset:
        return f"the layout is placed from rank {ml.offset}"
    if ml.ep > 1:
        return f"ep={ml.ep} spreads the experts over the data-parallel ranks"
    whole = [d for d in range(ml.dp) if set(_replica_ranks(ml, d)) <= able]
    if not whole:
        return "no whole data-parallel replica survived (a rank map for partial replicas is not built)"
    if ml.zero and len(whole) < ml.dp:
        return f"zero={ml.zero} splits the optimizer states over the data-parallel ranks"
    k = len(whole)
    module = dataclasses.replace(ml, dp=k)
    source = str(Layout(modules=(dataclasses.replace(module, module=placement.layout.modules[0].module),)))
    ranks: list[tuple[int, int]] = []
    for j, d in enumerate(whole):
        ranks += zip(_replica_ranks(ml, d), _replica_ranks(module, j))
    ranks.sort(key=lambda pair: pair[1])
    used = {old for old, _ in ranks}
    extra = sorted(alive - used)
    ranks += [(old, k * ml.tp * ml.pp * ml.cp + i) for i, old in enumerate(extra)]
    return SurvivorWorld(source, k * ml.tp * ml.pp * ml.cp, tuple(ranks))


def survivors_cover(placement: Placement, survivors: Iterable[int]) -> str:
    """"" when the survivors hold every state element, else what they miss (for the row)."""
    ranks = set(survivors)
    missing = uncovered(placement, ranks)
    if not missing:
        return ""
    name, state_class = missing[0]
    return (f"the surviving ranks ({len(ranks)} of {placement.world}) no longer held every state element "
            f"({len(missing)} tensor states incomplete, e.g. {name} {state_class})")


def recovery_rule(placement: Placement, survivors: Mapping[int, int], *, transition_active: bool,
                  no_checkpoint: str | None) -> Recovery:
    """survivors: old rank -> the step it outlived its world at (ranks that reported waiting,
    on healthy nodes); the job goes on at the latest of those steps. no_checkpoint: why no checkpoint restore is possible (None: it is)."""
    why = survivors_refusal(placement, survivors, transition_active=transition_active)
    if isinstance(why, SurvivorWorld):
        return Recovery(SURVIVORS, "", why)
    if no_checkpoint is None:
        return Recovery(CHECKPOINT, why)
    return Recovery(FAIL, f"{no_checkpoint}; the survivors could not take over: {why}")


def survivors_refusal(placement: Placement, survivors: Mapping[int, int], *,
                      transition_active: bool) -> SurvivorWorld | str:
    """The survivors' world, or why they cannot take over (the first rule they break)."""
    if transition_active:
        return "a layout switch was active when the ranks were lost"
    if not survivors:
        return "no surviving rank outlived its world (none reported waiting for a recovery order)"
    steps = sorted(set(survivors.values()))
    latest = [rank for rank, step in survivors.items() if step == steps[-1]]
    missing = survivors_cover(placement, latest)
    if missing:
        if len(steps) > 1:
            return (f"the surviving ranks stopped at different steps {steps}, and those at step {steps[-1]} "
                    f"(ranks {sorted(latest)}) no longer held every state element")
        return missing
    return survivors_source(placement, survivors, latest)
