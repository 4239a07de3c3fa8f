"""plan_routes(model, src, dst) -> RoutingPlan: the pure planner behind `dynaplane plan`
and the transition engine. Every rank computes the same plan from the same inputs and
checks the fingerprint (sha256 of a canonical form) with its peers before moving data.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from agents.layout.estimate import Network, estimate_seconds
from agents.layout.placement import Placement, place
from agents.layout.routing import Route, route
from agents.layout.schedule import RoundStats, Slice, SliceMemory, cut_rounds, memory_wave, round_stats
from agents.layout.shards import OPTIM, PARAM, STATE_CLASS, HolderBoxes, full_box, holder_boxes
from agents.layout.spec import Layout
from agents.layout.tensors import STATE_BYTES, STATES, Model

PLANNER_VERSION = 1


@dataclass(frozen=True, slots=True)
class PlanOptions:
    gpus_per_node: int = 8
    staging_bytes: int = 256 * 2**20
    network: Network = field(default_factory=Network)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be >= 1")
        if self.staging_bytes < 1:
            raise ValueError(f"staging budget {self.staging_bytes} B must be > 0")


@dataclass(frozen=True)
class Item:
    """One (tensor, state) of the model, in the global order."""

    tensor: int
    state: str
    route: Route


class RoutingPlan:
    def __init__(self, model: Model, src: Placement, dst: Placement, options: PlanOptions, items: list[Item],
                 rounds: list[list[Slice]], plan_seconds: float) -> None:
        self.model, self.src, self.dst, self.options = model, src, dst, options
        self.items, self.rounds, self.plan_seconds = items, rounds, plan_seconds
        self.world = max(src.world, dst.world)

    # --- per-item views ---------------------------------------------------------------
    def _bytes(self, item: Item) -> int:
        return STATE_BYTES[item.state]

    @cached_property
    def stats(self) -> RoundStats:
        return round_stats(self.rounds, [i.route for i in self.items], [self._bytes(i) for i in self.items],
                           self.world, self.options.gpus_per_node)

    @cached_property
    def waves(self) -> tuple[np.ndarray, np.ndarray]:
        """(after[rounds+1, world], peak[rounds, world]) predicted state bytes per rank."""
        start = np.zeros(self.world)
        for item in self.items:
            src = item.route.src_holders
            np.add.at(start, src.rank, src.size * self._bytes(item))
        effects: dict[tuple, SliceMemory] = {}
        per_route: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        order = [sl for round_slices in self.rounds for sl in round_slices]
        first_slice = {sl.item: sl for sl in reversed(order)}
        last_slice = {sl.item: sl for sl in order}
        none = (np.zeros(0, dtype=np.int64), np.zeros(0))
        for sl in order:
            item = self.items[sl.item]
            r, nbytes = item.route, self._bytes(item)
            if id(r) not in per_route:
                # A rank whose box is unchanged keeps the tensor as it is; ranks with a local
                # copy free their source box only after copying it.
                src, dst, loc = r.src_holders, r.dst_holders, r.local
                loc_elems = r.elements(loc)
                same = (loc_elems == src.size[np.searchsorted(src.rank, loc.rank)]) & (
                    loc_elems == dst.size[np.searchsorted(dst.rank, loc.rank)])
                per_route[id(r)] = (loc.rank[same], loc.rank)
            kept, local = per_route[id(r)]
            early, late, alloc = none, none, none
            if sl is first_slice[sl.item]:
                alloc = _boxes(r.dst_holders, nbytes, kept)
            if sl is last_slice[sl.item]:
                ranks, nb = _boxes(r.src_holders, nbytes, kept)
                is_late = np.isin(ranks, local)
                early, late = (ranks[~is_late], nb[~is_late]), (ranks[is_late], nb[is_late])
            effects[sl.key] = SliceMemory(early=early, late=late, alloc=alloc)
        return memory_wave(self.rounds, start, effects, self.stats, self.world)

    def _sum(self, what) -> int:
        return int(sum(int(what(i.route)) * self._bytes(i) for i in self.items))

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the plan's canonical form: inputs, every route and the round cuts."""
        h = hashlib.sha256()
        header = {"v": PLANNER_VERSION, "model": self.model.name, "params": self.model.param_count,
                  "src": str(self.src.layout), "dst": str(self.dst.layout),
                  "gpus_per_node": self.options.gpus_per_node, "staging": self.options.staging_bytes}
        h.update(json.dumps(header, sort_keys=True).encode())
        seen: dict[int, int] = {}
        for item in self.items:
            r = item.route
            ref = seen.setdefault(id(r), len(seen))
            h.update(f"{item.tensor}:{item.state}:{ref};".encode())
            if ref == len(seen) - 1:
                for arr in (r.src, r.dst, r.boxes.a0, r.boxes.a1, r.boxes.b0, r.boxes.b1, r.local.rank, r.local.a0,
                            r.local.a1, r.local.b0, r.local.b1, r.derived.rank, r.derived.a0, r.derived.a1):
                    h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
        for k, round_slices in enumerate(self.rounds):
            h.update(f"R{k}:".encode() + ",".join(f"{s.item}/{s.a_lo}/{s.a_hi}/{s.t_lo}/{s.t_hi}" for s in round_slices).encode())
        return h.hexdigest()

    def summary(self) -> dict:
        """CONTRACTS section 3's --json object (and a few more fields)."""
        stats = self.stats
        after, peak = self.waves
        send = stats.send_intra + stats.send_inter
        recv = stats.recv_intra + stats.recv_inter
        seconds, _ = estimate_seconds(stats, self.options.network)
        state_src = int(after[0].sum())
        network = self._sum(lambda r: r.transfer_elems)
        local = self._sum(lambda r: r.elements(r.local).sum())
        derived = self._sum(lambda r: r.elements(r.derived).sum())
        need = self._sum(lambda r: r.need_elems)
        return {
            "model": self.model.name, "src": str(self.src.layout), "dst": str(self.dst.layout),
            "world_src": self.src.world, "world_dst": self.dst.world,
            "state_bytes_src": state_src, "state_bytes_dst": need,
            "local_bytes": local, "derived_bytes": derived, "network_bytes": network,
            "min_network_bytes": need - local - derived,
            "transfers": stats.transfers, "rounds": len(self.rounds),
            "max_rank_send_bytes": int(send.sum(axis=0).max(initial=0)),
            "max_rank_recv_bytes": int(recv.sum(axis=0).max(initial=0)),
            "peak_staging_bytes": int((send + recv).max(initial=0)),
            "staging_budget_bytes": self.options.staging_bytes,
            "predicted_peak_bytes": int(peak.max(initial=0)),
            # Per rank max(source, destination) + staging: the peak a perfect schedule reaches.
            "ranks_over_memory_bound": int((peak.max(axis=0, initial=0)
                                            > np.maximum(after[0], after[-1]) + self.options.staging_bytes).sum()),
            # Checkpoint-restart writes every logical state element once and reads it once.
            "checkpoint_bytes": 2 * self.model.param_count * sum(STATE_BYTES.values()),
            "plan_seconds": round(self.plan_seconds, 4), "estimated_seconds": seconds,
            "fingerprint": self.fingerprint,
        }

    def dump(self) -> dict:
        """CONTRACTS section 3's --dump object: every tensor, shard, transfer, local copy
        and derived box, in global coordinates. Meant for small cases."""
        tensors = self.model.tensors
        out: dict = {"tensors": [{"name": t.name, "shape": list(t.shape), "state": s, "dtype_bytes": STATE_BYTES[s],
                                  "split": {"module": t.split.module, "layer": t.split.layer, "place": t.split.place,
                                            "tp_dim": t.split.tp_dim, "tp_units": t.split.tp_units,
                                            "ep_dim": t.split.ep_dim}}
                                 for t in tensors for s in STATES]}
        for key, placement in (("src", self.src), ("dst", self.dst)):
            shards = []
            for t in tensors:
                for s in STATES:
                    b = holder_boxes(placement, t, STATE_CLASS[s])
                    for i in range(len(b.rank)):
                        off, ln = full_box(t, b.a0[i], b.a1[i], b.b0[i], b.b1[i])
                        shards.append({"rank": int(b.rank[i]), "tensor": t.name, "state": s, "offsets": off,
                                       "lengths": ln})
            out[key] = {"layout": str(placement.layout), "world": placement.world, "shards": shards}
        out["transfers"], out["local"], out["derived"] = [], [], []
        for k, round_slices in enumerate(self.rounds):
            for sl in round_slices:
                item = self.items[sl.item]
                t, r = tensors[item.tensor], item.route
                for i in sl.transfers(r):
                    a0, a1 = max(int(r.boxes.a0[i]), sl.a_lo), min(int(r.boxes.a1[i]), sl.a_hi)
                    if a1 > a0:
                        off, ln = full_box(t, a0, a1, r.boxes.b0[i], r.boxes.b1[i])
                        out["transfers"].append({"round": k, "src": int(r.src[i]), "dst": int(r.dst[i]),
                                                 "tensor": t.name, "state": item.state, "offsets": off, "lengths": ln})
        for item in self.items:
            t, r = tensors[item.tensor], item.route
            for kind, pieces in (("local", r.local), ("derived", r.derived)):
                for i in range(len(pieces)):
                    off, ln = full_box(t, pieces.a0[i], pieces.a1[i], pieces.b0[i], pieces.b1[i])
                    row = {"rank": int(pieces.rank[i]), "tensor": t.name, "state": item.state, "offsets": off,
                           "lengths": ln}
                    if kind == "derived":
                        row["from_state"] = "master"
                    out[kind].append(row)
        return out


def _boxes(boxes: HolderBoxes, nbytes: int, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, bytes) of the boxes, leaving out `kept` ranks."""
    keep = ~np.isin(boxes.rank, kept)
    return boxes.rank[keep], (boxes.size[keep] * nbytes).astype(np.float64)


def _stage_fractions(model: Model, placement: Placement) -> dict[int, float]:
    """Each layer tensor's position within the pipeline stage holding it, in [0, 1]."""
    layers: dict[tuple[str, int], list[int]] = {}
    for m in model.modules:
        for layer in range(m.num_layers):
            stage = placement.tensor_stages(next(t for t in model.tensors if t.split.module == m.name
                                                 and t.split.layer == layer))[0]
            layers.setdefault((m.name, stage), []).append(layer)
    position = {}
    for (module, _), held in layers.items():
        for j, layer in enumerate(held):
            position[(module, layer)] = (j + 0.5) / len(held)
    return {i: position[(t.split.module, t.split.layer)] for i, t in enumerate(model.tensors) if t.split.layer is not None}


def transfer_order(model: Model, src: Placement, dst: Placement) -> list[int]:
    """The global order in which tensors move: by position within their pipeline stage
    (mean of source and destination), so that a rank that changes stage frees its old
    layers while it fills its new ones instead of holding both; embeddings first and
    output layers last. Every rank computes the same order."""
    fs, fd = _stage_fractions(model, src), _stage_fractions(model, dst)
    place_key = {"first": 0.0, "first+last": 0.0, "last": 1.0}
    keys = [((fs[i] + fd[i]) / 2 if t.split.layer is not None else place_key[t.split.place], i)
            for i, t in enumerate(model.tensors)]
    return [i for _, i in sorted(keys)]


def plan_routes(model: Model, src: Layout | str, dst: Layout | str, options: PlanOptions | None = None) -> RoutingPlan:
    """Plan moving every state tensor of `model` from layout `src` to layout `dst`."""
    started = time.perf_counter()
    options = options or PlanOptions()
    src_p, dst_p = place(model, src), place(model, dst)
    routes: dict[tuple, Route] = {}
    items: list[Item] = []
    for index in transfer_order(model, src_p, dst_p):
        tensor = model.tensors[index]
        split = tensor.split
        geometry = (tensor.shape, split.module, split.tp_dim, split.tp_units, split.ep_dim, split.place,
                    src_p.tensor_stages(tensor), dst_p.tensor_stages(tensor))
        for state_class in (PARAM, OPTIM):
            key = (geometry, state_class)
            if key not in routes:
                dst_boxes = holder_boxes(dst_p, tensor, state_class)
                master = holder_boxes(dst_p, tensor, OPTIM) if state_class == PARAM else None
                routes[key] = route(holder_boxes(src_p, tensor, state_class), dst_boxes, master,
                                    gpus_per_node=options.gpus_per_node, salt=len(routes))
        for state in STATES:
            items.append(Item(index, state, routes[(geometry, STATE_CLASS[state])]))
    world = max(src_p.world, dst_p.world)
    rounds = cut_rounds([i.route for i in items], [STATE_BYTES[i.state] for i in items],
                        [model.tensors[i.tensor].shape[0] for i in items], options.staging_bytes, world)
    return RoutingPlan(model, src_p, dst_p, options, items, rounds, time.perf_counter() - started)
