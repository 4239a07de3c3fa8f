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

from parallelism.planner.estimate import Network, estimate_seconds
from parallelism.layout.placement import Placement, place
from parallelism.planner.rank_map import Savings, best_map, geometry, relabel, savings
from parallelism.planner.routing import Route, route
from parallelism.planner.schedule import RoundStats, Slice, cut_rounds, memory_wave, round_stats, slice_memory
from parallelism.layout.shards import OPTIM, PARAM, STATE_CLASS, full_box, holder_boxes
from parallelism.layout.spec import Layout
from parallelism.layout.tensors import STATE_BYTES, STATES, Model, TensorSpec

PLANNER_VERSION = 3


@dataclass(frozen=True, slots=True)
class PlanOptions:
    gpus_per_node: int = 8
    staging_bytes: int = 256 * 2**20
    network: Network = field(default_factory=Network)
    # Choose which process takes which destination rank so that the fewest bytes move
    # (rank_map.py). Off: the contract's order, process d takes destination rank d.
    map_ranks: bool = False

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
    """Routes and rounds in the union world's process numbers: process p holds source rank
    p and takes destination rank `dst_rank(p)` (p itself unless a device map was chosen)."""

    def __init__(self, model: Model, src: Placement, dst: Placement, options: PlanOptions, items: list[Item],
                 rounds: list[list[Slice]], plan_seconds: float, process_of: np.ndarray | None = None,
                 map_savings: Savings | None = None) -> None:
        self.model, self.src, self.dst, self.options = model, src, dst, options
        self.items, self.rounds, self.plan_seconds = items, rounds, plan_seconds
        self.world = max(src.world, dst.world)
        self.process_of = process_of  # process of each destination rank; None: rank d on process d
        self._savings = map_savings

    def dst_rank(self, process: int) -> int | None:
        """The destination rank the process takes (None: it leaves the job)."""
        if self.process_of is None:
            return process if process < self.dst.world else None
        hit = np.flatnonzero(self.process_of == process)
        return int(hit[0]) if len(hit) else None

    @property
    def renumbered(self) -> int:
        """Destination ranks that run on another process than their number."""
        if self.process_of is None:
            return 0
        return int((self.process_of != np.arange(self.dst.world)).sum())

    @cached_property
    def savings(self) -> Savings:
        """The device-map weights (rank_map.savings), for min_network_bytes."""
        return self._savings if self._savings is not None else savings(self.model, self.src, self.dst)

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
            start[src.rank] += src.size * self._bytes(item)  # one box per rank
        effects, never_read, never_written = slice_memory(
            self.rounds, [i.route for i in self.items], [self._bytes(i) for i in self.items], self.world)
        return memory_wave(self.rounds, start, effects, self.stats, self.world, never_read, never_written)

    @cached_property
    def largest_boxes(self) -> np.ndarray:
        """Per rank: the largest box (bytes) it frees or allocates, i.e. of a (tensor,
        state) whose box differs between the layouts. Boxes are freed whole, so a rank can
        need up to this much over max(source, destination) + staging (two ranks swapping
        boxes larger than the staging budget: docs/planner.md)."""
        out = np.zeros(self.world)
        seen: set[tuple[int, int]] = set()
        for item in self.items:
            r, nbytes = item.route, self._bytes(item)
            if (id(r), nbytes) in seen:
                continue
            seen.add((id(r), nbytes))
            for h in (r.src_holders, r.dst_holders):
                moving = ~np.isin(h.rank, r.kept)
                np.maximum.at(out, h.rank[moving], h.size[moving] * float(nbytes))
        return out

    def _sum(self, what) -> int:
        return int(sum(int(what(i.route)) * self._bytes(i) for i in self.items))

    @cached_property
    def network_bytes(self) -> int:
        """Bytes the plan sends between processes."""
        return self._sum(lambda r: r.transfer_elems)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the plan's canonical form: inputs, every route and the round cuts."""
        h = hashlib.sha256()
        header = {"v": PLANNER_VERSION, "model": self.model.name, "params": self.model.param_count,
                  "src": str(self.src.layout), "dst": str(self.dst.layout),
                  "gpus_per_node": self.options.gpus_per_node, "staging": self.options.staging_bytes,
                  "process_of": None if self.process_of is None else [int(p) for p in self.process_of]}
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
        """docs/contracts.md section 3's --json object (and a few more fields)."""
        stats = self.stats
        after, peak = self.waves
        rank_peak = peak.max(axis=0, initial=0)
        bound = np.maximum(after[0], after[-1]) + self.options.staging_bytes
        send = stats.send_intra + stats.send_inter
        recv = stats.recv_intra + stats.recv_inter
        seconds, _ = estimate_seconds(stats, self.options.network)
        state_src = int(after[0].sum())
        network = self.network_bytes
        local = self._sum(lambda r: r.elements(r.local).sum())
        derived = self._sum(lambda r: r.elements(r.derived).sum())
        need = self._sum(lambda r: r.need_elems)
        return {
            "model": self.model.name, "src": str(self.src.layout), "dst": str(self.dst.layout),
            "world_src": self.src.world, "world_dst": self.dst.world,
            "state_bytes_src": state_src, "state_bytes_dst": need,
            "local_bytes": local, "derived_bytes": derived, "network_bytes": network,
            # No device-to-rank map moves less (rank_map.py); network_bytes is what this map moves.
            "min_network_bytes": self.savings.network_floor,
            "ranks_renumbered": self.renumbered,
            "contract_order_network_bytes": self.savings.network_of(None),
            "transfers": stats.transfers, "rounds": len(self.rounds),
            "max_rank_send_bytes": int(send.sum(axis=0).max(initial=0)),
            "max_rank_recv_bytes": int(recv.sum(axis=0).max(initial=0)),
            "peak_staging_bytes": int((send + recv).max(initial=0)),
            "staging_budget_bytes": self.options.staging_bytes,
            "predicted_peak_bytes": int(peak.max(initial=0)),
            # Per rank max(source, destination) + staging: the peak a perfect schedule reaches
            # when state could be freed byte by byte; with whole boxes, + the largest box.
            "ranks_over_memory_bound": int((rank_peak > bound).sum()),
            "ranks_over_box_bound": int((rank_peak > bound + self.largest_boxes).sum()),
            # Checkpoint-restart writes every logical state element once and reads it once.
            "checkpoint_bytes": 2 * self.model.param_count * sum(STATE_BYTES.values()),
            "plan_seconds": round(self.plan_seconds, 4), "estimated_seconds": seconds,
            "fingerprint": self.fingerprint,
        }

    def dump(self) -> dict:
        """docs/contracts.md section 3's --dump object: every tensor, shard, transfer, local copy
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
                    if key == "dst":  # in process numbers, as the transfers
                        b = relabel(b, self.process_of)
                    for i in range(len(b.rank)):
                        off, ln = full_box(t, b.a0[i], b.a1[i], b.b0[i], b.b1[i])
                        shards.append({"rank": int(b.rank[i]), "tensor": t.name, "state": s, "offsets": off,
                                       "lengths": ln})
            out[key] = {"layout": str(placement.layout), "world": placement.world, "shards": shards}
        if self.process_of is not None:
            out["dst"]["process_of_rank"] = [int(p) for p in self.process_of]
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


def _kind(tensor: TensorSpec) -> str:
    """A layer tensor's name without its layer index ("llm.layers.*.mlp.up.weight"): the
    tensors of one kind have the same shape in every layer."""
    parts = tensor.name.split(".")
    if str(tensor.split.layer) in parts:
        parts[parts.index(str(tensor.split.layer))] = "*"
    return ".".join(parts)


def transfer_order(model: Model, src: Placement, dst: Placement) -> list[tuple[int, str]]:
    """The global order in which (tensor, state) items move; every rank computes the same.

    Kind first: the items of one layer-tensor kind and state (say the `exp_avg` of every
    layer's mlp.up) move together, kinds in the order a layer lists them, states in STATES
    order; within such a group, layers by their position inside their source pipeline
    stage, so that all stages proceed at once. A rank then frees its old boxes and fills
    its new ones group by group, at the same pace even when its pipeline stage changes
    (its old and new layers are different tensors), and each group is a small part of its
    memory. Several modules' groups interleave by their relative position. Tensors outside
    the layers: first-stage ones (embeddings) first, last-stage ones last.
    The earlier order, whole layers by their position in the stage, let a rank that
    changes stage fill new layers well before it freed old ones (up to 1.27x max(source,
    destination) + staging; docs/benchmarks-history.md, session 2)."""
    position = _stage_fractions(model, src)
    kinds: dict[str, dict[str, int]] = {}
    for t in model.tensors:
        if t.split.layer is not None:
            module = kinds.setdefault(t.split.module, {})
            module.setdefault(_kind(t), len(module))
    place_key = {"first": -1.0, "first+last": -1.0, "last": 2.0}
    keys = []
    for i, t in enumerate(model.tensors):
        for s, state in enumerate(STATES):
            if t.split.layer is None:
                keys.append(((place_key[t.split.place], 0.0, i, s), (i, state)))
            else:
                module = kinds[t.split.module]
                group = (module[_kind(t)] * len(STATES) + s + 0.5) / (len(module) * len(STATES))
                keys.append(((group, position[i], i, s), (i, state)))
    return [item for _, item in sorted(keys)]


def plan_routes(model: Model, src: Layout | str, dst: Layout | str, options: PlanOptions | None = None, *,
                process_of: np.ndarray | None = None) -> RoutingPlan:
    """Plan moving every state tensor of `model` from layout `src` to layout `dst`.
    `process_of` (process of each destination rank) imposes a device map; else
    options.map_ranks chooses the best one, or the contract's order is kept."""
    started = time.perf_counter()
    options = options or PlanOptions()
    src_p, dst_p = place(model, src), place(model, dst)
    chosen = None
    if process_of is not None:
        process_of = _check_map(np.asarray(process_of, dtype=np.int64), src_p, dst_p)
        if np.array_equal(process_of, np.arange(dst_p.world)):
            process_of = None  # the contract's order, said out loud: the same plan and fingerprint
    elif options.map_ranks:
        process_of, chosen = best_map(model, src_p, dst_p)
    routes: dict[tuple, Route] = {}
    items: list[Item] = []
    for index, state in transfer_order(model, src_p, dst_p):
        tensor = model.tensors[index]
        state_class = STATE_CLASS[state]
        key = (geometry(tensor, src_p, dst_p), state_class)
        if key not in routes:  # tensors of one geometry share a route
            dst_boxes = relabel(holder_boxes(dst_p, tensor, state_class), process_of)
            master = relabel(holder_boxes(dst_p, tensor, OPTIM), process_of) if state_class == PARAM else None
            routes[key] = route(holder_boxes(src_p, tensor, state_class), dst_boxes, master,
                                gpus_per_node=options.gpus_per_node, salt=len(routes))
        items.append(Item(index, state, routes[key]))
    world = max(src_p.world, dst_p.world)
    rounds = cut_rounds([i.route for i in items], [STATE_BYTES[i.state] for i in items],
                        [model.tensors[i.tensor].shape[0] for i in items], options.staging_bytes, world)
    return RoutingPlan(model, src_p, dst_p, options, items, rounds, time.perf_counter() - started, process_of, chosen)


def _check_map(process_of: np.ndarray, src: Placement, dst: Placement) -> np.ndarray:
    union = max(src.world, dst.world)
    if process_of.shape != (dst.world,) or len(set(process_of.tolist())) != dst.world \
            or process_of.min(initial=0) < 0 or process_of.max(initial=0) >= union:
        raise ValueError(f"a device map gives each of the {dst.world} destination ranks its own process "
                         f"0..{union - 1}; got {process_of.tolist()[:16]}")
    return process_of
