"""An executable oracle for plans: every logical element gets an id, the plan is run over
plain numpy arrays (one dict of buffers per rank), and each destination rank must end
holding exactly the ids its layout assigns it, each written exactly once."""
from __future__ import annotations

import numpy as np

from parallelism.planner.plan import RoutingPlan
from parallelism.layout.tensors import STATES

STATE_INDEX = {s: i for i, s in enumerate(STATES)}


def _ids(shape: tuple[int, ...], state: str, tensor_index: int) -> np.ndarray:
    """A unique id per (tensor, state, element); `param` and `master` of one element differ
    only in the state digit, so a derived param is master - 1."""
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return (base * 64 + tensor_index) * 4 + STATE_INDEX[state]


def _region(offsets, lengths):
    return tuple(slice(o, o + n) for o, n in zip(offsets, lengths))


def local_copies_are_scheduled(plan: RoutingPlan) -> None:
    """The engine copies a slice's rows locally only in that item's slices that start its
    transfers (t_lo == 0): every local piece's rows must lie in such slices."""
    rows: dict[int, list[tuple[int, int]]] = {}
    for round_slices in plan.rounds:
        for sl in round_slices:
            if sl.t_lo == 0:
                rows.setdefault(sl.item, []).append((sl.a_lo, sl.a_hi))
    for i, item in enumerate(plan.items):
        loc = item.route.local
        covered = sorted(rows.get(i, []))
        for a0, a1 in zip(loc.a0.tolist(), loc.a1.tolist()):
            for lo, hi in covered:
                if lo <= a0 < hi:
                    a0 = hi
            assert a0 >= a1, (f"{plan.model.tensors[item.tensor].name}/{item.state}: local rows from {a0} "
                              f"to {a1} are in no slice")


def simulate(plan: RoutingPlan) -> None:
    local_copies_are_scheduled(plan)
    dump = plan.dump()
    index = {t.name: i for i, t in enumerate(plan.model.tensors)}
    shapes = {t.name: t.shape for t in plan.model.tensors}
    full = {(t, s): _ids(shapes[t], s, index[t]) for t in shapes for s in STATES}

    def boxes(shards):
        return {(r["rank"], r["tensor"], r["state"]): (r["offsets"], r["lengths"]) for r in shards}

    src, dst = boxes(dump["src"]["shards"]), boxes(dump["dst"]["shards"])
    # What the source ranks hold, as global arrays with -1 outside their box.
    held = {}
    for key, (off, ln) in src.items():
        buf = np.full(shapes[key[1]], -1, dtype=np.int64)
        buf[_region(off, ln)] = full[key[1:]][_region(off, ln)]
        held[key] = buf
    out = {key: np.full(shapes[key[1]], -1, dtype=np.int64) for key in dst}
    writes = {key: np.zeros(shapes[key[1]], dtype=np.int64) for key in dst}

    def write(key, off, ln, values, what):
        assert key in out, f"{what} writes {key} which the destination layout does not hold"
        region = _region(off, ln)
        assert (values >= 0).all(), f"{what} for {key} reads elements its source does not hold"
        out[key][region] = values
        writes[key][region] += 1

    for row in dump["local"]:
        key = (row["rank"], row["tensor"], row["state"])
        assert key in held, f"local copy on rank {key[0]} of {key[1:]} it never held"
        write(key, row["offsets"], row["lengths"], held[key][_region(row["offsets"], row["lengths"])], "local")
    rounds = sorted({t["round"] for t in dump["transfers"]})
    assert rounds == list(range(len(rounds))), "rounds are numbered 0..R-1 without gaps"
    for row in dump["transfers"]:
        src_key = (row["src"], row["tensor"], row["state"])
        assert src_key in held, f"transfer from rank {row['src']} of {row['tensor']}/{row['state']} it never held"
        assert row["src"] != row["dst"], "a transfer to oneself should have been a local copy"
        write((row["dst"], row["tensor"], row["state"]), row["offsets"], row["lengths"],
              held[src_key][_region(row["offsets"], row["lengths"])], "transfer")
    for row in dump["derived"]:
        key = (row["rank"], row["tensor"], row["state"])
        master = out[(row["rank"], row["tensor"], row["from_state"])][_region(row["offsets"], row["lengths"])]
        write(key, row["offsets"], row["lengths"], np.where(master >= 0, master - 1, -1), "derived")

    for key, (off, ln) in dst.items():
        region = _region(off, ln)
        assert (writes[key][region] == 1).all(), f"{key}: elements written {np.unique(writes[key][region])} times"
        assert (out[key][region] == full[key[1:]][region]).all(), f"{key}: wrong values"
        mask = np.ones(shapes[key[1]], bool)
        mask[region] = False
        assert (writes[key][mask] == 0).all(), f"{key}: written outside its box"
