"""A synthetic day of training jobs for the elastic scheduler benchmark (seeded).

The mix, sized to the cluster (GPU counts are fractions of it, in whole nodes):
- long pre-training runs, elastic, priority 0: two llama3-70b and two llama3-8b running
  from the start of the day (40-80 hours of work at the size they ask for), one more of
  each arriving;
- fine-tuning runs: elastic llama3-8b, priority 1, about one an hour, 2-6 hours of work
  (range 1/64-1/8); rigid llama3-8b on 1/32 of the cluster, priority 1, 1.5 an hour, 1-4 hours;
- small experiments: rigid llama-124m on one node, priority 1, four an hour, 20-90 min;
- priority jobs (an eval, an RL rollout phase): rigid llama3-8b on 1/8 of the cluster,
  priority 10, one every three hours on average, 45-75 minutes each.
Step times: the resize proposals' prediction (controlplane/jobs/proposals.py) scaled from
one reference step time per model (`Template.step_seconds` at `Template.layout`); a job's
work is its steps, fixed at arrival from its duration at its requested size.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from parallelism.layout.catalog import get_model
from parallelism.layout.elastic_inputs import SizeOption
from controlplane.jobs.elastic_options import candidate_sizes, size_options

HOUR = 3600.0
GPU_BYTES = 80 * 2**30


@dataclass(frozen=True)
class Template:
    kind: str
    model: str
    layout: str                 # the reference layout, measured at step_seconds
    step_seconds: float
    global_batch: int
    seq_len: int
    elastic: bool
    priority: int
    gpus: int                   # the requested size: the start size when rigid, the static allocation
    min_gpus: int
    max_gpus: int


@dataclass(frozen=True)
class Arrival:
    at: float
    name: str
    template: Template
    steps: int
    options: tuple[SizeOption, ...] = field(compare=False)


def _nodes(fraction: float, nodes: int, per_node: int, least: int = 1) -> int:
    """A fraction of the cluster in whole nodes, at least `least` GPUs' worth."""
    return max(1, round(fraction * nodes), math.ceil(least / per_node)) * per_node


def templates(nodes: int, per_node: int) -> dict[str, Template]:
    n = lambda fraction, least=1: _nodes(fraction, nodes, per_node, least)  # noqa: E731
    return {
        # llama3-70b's state (~1 TB) needs 16 GPUs of 80 GiB at least
        "pretrain-70b": Template("pretrain-70b", "llama3-70b", "tp=2,dp=32,zero=1", 10.0, 1024, 4096, True, 0,
                                 n(1 / 4, 32), n(1 / 8, 16), n(1 / 2, 64)),
        "pretrain-8b": Template("pretrain-8b", "llama3-8b", "dp=64,zero=1", 2.0, 1024, 4096, True, 0,
                                n(1 / 8), n(1 / 16), n(1 / 4)),
        "finetune-elastic": Template("finetune-elastic", "llama3-8b", "dp=64,zero=1", 2.0, 1024, 4096, True, 1,
                                     n(1 / 32), n(1 / 64), n(1 / 8)),
        "finetune-rigid": Template("finetune-rigid", "llama3-8b", "dp=64,zero=1", 2.0, 1024, 4096, False, 1,
                                   n(1 / 32), n(1 / 32), n(1 / 32)),
        "experiment": Template("experiment", "llama-124m", "dp=8", 0.25, 512, 1024, False, 1,
                               per_node, per_node, per_node),
        "priority": Template("priority", "llama3-8b", "dp=64,zero=1", 2.0, 1024, 4096, False, 10,
                             n(1 / 8), n(1 / 8), n(1 / 8)),
    }


def options_of(t: Template, per_node: int, cache: dict) -> tuple[SizeOption, ...]:
    """The template's size options, ranked by the proposals, computed once per template and
    size: sizes in steps of a quarter of min_gpus (whole nodes), to keep the ranking cheap."""
    key = (t.kind, t.gpus, t.min_gpus, t.max_gpus)
    if key not in cache:
        step = max(per_node, t.min_gpus // 4 // per_node * per_node)
        sizes = [s for s in candidate_sizes(t.min_gpus, t.max_gpus, per_node) if s % step == 0 or s == t.gpus]
        sizes = sizes if t.elastic else [t.gpus]
        cache[key] = size_options(get_model(t.model), layout=t.layout, sizes=sizes, global_batch=t.global_batch,
                                  micro_batch=1, seq_len=t.seq_len, step_seconds=t.step_seconds,
                                  capacity_bytes=GPU_BYTES)
    return cache[key]


# kind, arrivals per hour, hours of work (uniform between the two)
ARRIVALS = (("finetune-elastic", 1.0, 2, 6), ("finetune-rigid", 1.5, 1, 4), ("experiment", 4.0, 1 / 3, 1.5),
            ("priority", 1 / 3, 0.75, 1.25))


def day_trace(seed: int, *, nodes: int = 128, per_node: int = 8, hours: float = 24.0) -> list[Arrival]:
    """Arrivals over `hours`, sorted by time; the same seed gives the same day."""
    rng = random.Random(seed)
    kinds = templates(nodes, per_node)
    cache: dict = {}
    out: list[Arrival] = []

    def add(at: float, kind: str, hours_of_work: float) -> None:
        t = kinds[kind]
        options = options_of(t, per_node, cache)
        own = next(o for o in options if o.gpus == t.gpus)
        steps = max(1, int(hours_of_work * HOUR / own.step_seconds))
        out.append(Arrival(at, f"{kind}-{len(out) + 1}", t, steps, options))

    for kind in ("pretrain-70b", "pretrain-70b", "pretrain-8b", "pretrain-8b"):
        add(0.0, kind, rng.uniform(40, 80))
    for kind in ("pretrain-70b", "pretrain-8b"):
        add(rng.uniform(0, hours * HOUR), kind, rng.uniform(40, 80))
    for kind, per_hour, low, high in ARRIVALS:
        at = rng.expovariate(per_hour) * HOUR
        while at < hours * HOUR:
            add(at, kind, rng.uniform(low, high))
            at += rng.expovariate(per_hour) * HOUR
    return sorted(out, key=lambda a: (a.at, a.name))
