"""Parity checks for the heterogeneous (multimodal) trainer's layout tests: a run that hands
its state over after the first step, the whole exp_avg tensors assembled from every rank's
boxes, each tensor's first-moment error against a reference run, and the loss and gradient
parity checks against references within the layout noise test_hetero.py defines (losses:
3 x max(noise, 1e-3), noise the 1-rank vs homogeneous difference; gradients: per tensor
within 3 x max(homogeneous deviation, 0.02))."""
from __future__ import annotations

import torch

from parallelism.engine.launch import run_ranks
from parallelism.engine.shards import LocalShard, rank_boxes
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.layout.shards import b_dim
from parallelism.training.hetero import HeteroTrainer
from parallelism.training.parallel import TrainConfig, initial_shards

FLOOR = 1e-3


def hand_over_run(rank: int, world: int, config: TrainConfig, layout: str, steps: int) -> dict:
    """One step, hand over (exp_avg boxes = 0.1 * the step's gradient), adopt the shards in a
    new trainer and go on (run_ranks' fn): so the losses also check that hand-over and
    adoption are exact. Also whether the handed-over boxes are the planner's, and the LLM
    chunks this rank ran (interleaved pipelines)."""
    placement = place(get_model(config.model), layout)
    shards = initial_shards(placement, rank, config.seed) if rank < placement.world else {}
    trainer = HeteroTrainer(config, layout, rank, shards)
    chunks = [c.index for c in getattr(trainer, "chunks", [])] if trainer.llm_stage is not None else []
    losses = [trainer.step()]
    shards, scalars = trainer.hand_over()
    boxes_ok = {(k, s.box) for k, s in shards.items()} == set(rank_boxes(placement, rank).items())
    # numpy, not tensors: tensors leave a rank process as shared-memory handles that die with it.
    moments = {(k[0], s.box): s.data.float().numpy().copy() for k, s in shards.items() if k[1] == "exp_avg"}
    trainer = HeteroTrainer(config, layout, rank, shards, scalars)
    losses += [trainer.step() for _ in range(steps - 1)]
    return {"losses": [None if r is None else r.loss for r in losses], "moments": moments, "chunks": chunks,
            "boxes_ok": boxes_ok}


def run_layouts(layouts: dict[str, tuple[str, int, TrainConfig]], steps: int) -> dict[str, list[dict]]:
    """{name: (layout, world, config)} -> {name: every rank's hand_over_run result}."""
    return {name: run_ranks(world, hand_over_run, config, layout, steps, timeout_s=300)
            for name, (layout, world, config) in layouts.items()}


def whole(tensor, value: torch.Tensor) -> LocalShard:
    """The whole tensor's exp_avg box over `value`."""
    bd = b_dim(tensor)
    return LocalShard(tensor, "exp_avg", (0, tensor.shape[0], 0, tensor.shape[bd] if bd is not None else 0), value)


def full_moments(run: list[dict], model: str) -> dict[int, torch.Tensor]:
    """A run's exp_avg tensors assembled from every rank's boxes (replicas must agree)."""
    spec = get_model(model)
    full: dict[int, torch.Tensor] = {}
    for rank_result in run:
        for (index, box), value in rank_result["moments"].items():
            tensor = spec.tensors[index]
            shard = full.setdefault(index, torch.full(tensor.shape, float("nan")))
            whole(tensor, shard).region(box).copy_(torch.from_numpy(value))  # region is a view of `shard`
    for index, value in full.items():
        assert not value.isnan().any(), spec.tensors[index].name
    return full


def moment_errors(run: list[dict], reference: list[dict], model: str, floor: float = FLOOR) -> dict[str, float]:
    """Per tensor: the largest |exp_avg - reference's| over every rank's box, relative to the
    reference tensor's largest entry, at least floor x the largest entry of any tensor: a
    gradient that is zero in exact arithmetic (the encoder's k biases: softmax ignores a
    shift common to all keys) is rounding noise in every run, O(1) relative to itself
    (test_hetero.py), and is judged against the model's gradient scale instead
    (tests/support/first_step.py's floor). floor=0: relative to the tensor's own largest entry."""
    spec = get_model(model)
    full = full_moments(reference, model)
    least = floor * max(float(v.abs().max()) for v in full.values())
    errors: dict[str, float] = {}
    for rank_moments in run:
        for (index, box), value in rank_moments["moments"].items():
            tensor = spec.tensors[index]
            region = whole(tensor, full[index]).region(box)
            scale = max(float(full[index].abs().max()), least) + 1e-12
            errors[tensor.name] = max(errors.get(tensor.name, 0.0),
                                      float((torch.from_numpy(value) - region).abs().max()) / scale)
    return errors


def loss_bound(runs: dict[str, list[dict]]) -> tuple[float, float]:
    """(noise, allowed): the 1-rank vs homogeneous loss difference and 3 x max(noise, 1e-3)."""
    noise = max(abs(a - b) for a, b in zip(runs["single"][0]["losses"], runs["homogeneous"][0]["losses"]))
    return noise, 3 * max(noise, 1e-3)


def check_loss_parity(runs: dict[str, list[dict]], name: str, references: list[str]) -> None:
    """Every rank of run `name` reports the same global losses, within loss_bound of each reference's."""
    noise, allowed = loss_bound(runs)
    losses = runs[name][0]["losses"]
    for rank_result in runs[name]:
        assert rank_result["losses"] == losses  # every rank reports the global loss
    for reference in references:
        for step, (a, b) in enumerate(zip(losses, runs[reference][0]["losses"])):
            assert abs(a - b) <= allowed, (name, reference, step, a, b, noise)
    print(name, "noise", f"{noise:.2e}", {r: max(abs(a - b) for a, b in zip(losses, runs[r][0]["losses"]))
                                         for r in references})


def check_gradient_parity(runs: dict[str, list[dict]], name: str, references: list[str], model: str,
                          floor: float = FLOOR) -> None:
    """Every tensor's first-moment error of run `name` against each reference within
    3 x max(the homogeneous run's error against the 1-rank run, 0.02)."""
    spec = get_model(model)
    noise = moment_errors(runs["homogeneous"], runs["single"], model, floor)
    assert set(noise) == {t.name for t in spec.tensors}
    for reference in references:
        errors = moment_errors(runs[name], runs[reference], model, floor)
        assert set(errors) == {t.name for t in spec.tensors}  # every tensor of both modules checked
        worst = sorted(errors, key=lambda t: errors[t] / max(noise[t], 0.02))[-3:]
        print(name, "vs", reference, {t: (round(errors[t], 4), round(noise[t], 4)) for t in worst})
        for tensor, error in errors.items():
            assert error <= 3 * max(noise[tensor], 0.02), (name, reference, tensor, error, noise[tensor])
