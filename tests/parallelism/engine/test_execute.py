"""The engine on real gloo process groups: a plan executed on id-derived tensors leaves
every rank holding exactly its destination boxes, and the digests agree."""
from __future__ import annotations

import pytest
import torch

from parallelism.engine.digest import VerificationError, compare_digests, state_digests, unchanged_keys
from parallelism.engine.errors import EngineError
from parallelism.engine.execute import execute_plan
from parallelism.engine.progress import WaveRecorder
from parallelism.engine.launch import run_ranks
from parallelism.engine.shards import LocalShard, rank_boxes
from parallelism.engine.state_fill import value
from parallelism.layout.catalog import get_model
from parallelism.planner.plan import PlanOptions, plan_routes

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def truth(model, key, box) -> torch.Tensor:
    """Every element a function of (tensor, state, global index); param = bf16(master)."""
    return value(model, key, box)


def _switch(rank: int, world: int, model_name: str, src: str, dst: str, staging: int, corrupt: bool):
    model = get_model(model_name)
    plan = plan_routes(model, src, dst, PlanOptions(gpus_per_node=2, staging_bytes=staging))
    old = {key: LocalShard(model.tensors[key[0]], key[1], box, truth(model, key, box))
           for key, box in (rank_boxes(plan.src, rank).items() if rank < plan.src.world else [])}
    unchanged = unchanged_keys(plan)  # what the product's switch does not hash (kept untouched)
    before = state_digests(plan.src, rank, old, skip=unchanged)
    held = dict(old)
    samples: list[int] = []
    rounds_seen: list[int] = []
    recorder = WaveRecorder(lambda done, wave: rounds_seen.append(done))

    def sample(label: str, live: int) -> None:
        samples.append(live)
        recorder(label, live)

    new = execute_plan(plan, rank, old, sample=sample)
    # The measured wave has the planner's shape (start, then peak and after per round), one
    # on_round per round, and peaks no lower than what follows them.
    assert rounds_seen == list(range(1, len(plan.rounds) + 1))
    assert len(recorder.wave) == 2 * len(plan.rounds) + 1 and recorder.peak == max(samples)
    assert all(recorder.wave[2 * k + 1] >= recorder.wave[2 * k + 2] for k in range(len(plan.rounds)))
    expected = rank_boxes(plan.dst, rank) if rank < plan.dst.world else {}
    assert set(new) == set(expected)
    # The engine keeps its live bytes as a running total: at the end it must equal a recount.
    assert samples and samples[-1] == sum({id(s.data): s.nbytes for s in new.values()}.values())
    for key, box in expected.items():
        assert new[key].box == box
        if key in unchanged and key in held and held[key].box == box:
            assert new[key] is held[key], "a box the digests skip must be the very tensor the rank held"
        assert torch.equal(new[key].data, truth(model, key, box)), (model.tensors[key[0]].name, key[1], rank)
    if corrupt and rank == 1:
        key = sorted(k for k in new if k[1] == "exp_avg")[0]
        new[key].data.view(-1)[0] += 1.0
    after = state_digests(plan.dst, rank, new, skip=unchanged)
    _, peak = plan.waves
    predicted = float(peak[:, rank].max(initial=0)) if rank < peak.shape[1] else 0.0
    measured = max(samples, default=0)
    assert measured <= predicted, f"rank {rank}: measured peak {measured} B above the predicted {predicted:.0f} B"
    try:
        checks = compare_digests(model, before, after)
        assert [row["name"] for row in checks] == [t.name for t in model.tensors] and all(r["match"] for r in checks)
        return ("ok", (measured, predicted))
    except VerificationError as exc:
        bad = [(row["name"], row["mismatched"]) for row in exc.checks if not row["match"]]
        return ("mismatch", str(exc), bad)


CASES = [
    ("same size, tp and zero change", "tp=2,dp=2,zero=1", "tp=4,zero=0"),
    ("grow, pp and zero=3", "dp=2,zero=1", "tp=2,pp=2,zero=3"),
    ("shrink, pp to dp", "tp=2,pp=2,zero=1", "dp=2,zero=3"),
    ("pp change with vpp", "pp=2,vpp=2,dp=2", "tp=2,pp=2,zero=2"),
]


def test_rows_fanned_out_beyond_the_budget_are_sent_over_several_rounds() -> None:
    results = run_ranks(4, _switch, "tiny-gpt", "dp=1", "dp=4", 2048, False, timeout_s=120)
    assert all(status == "ok" for status, *_ in results), results


@pytest.mark.parametrize(("name", "src", "dst"), CASES, ids=[c[0] for c in CASES])
def test_switch_is_exact_and_verified(name: str, src: str, dst: str) -> None:
    from parallelism.layout.spec import parse_layout

    world = max(parse_layout(src).world, parse_layout(dst).world)
    results = run_ranks(world, _switch, "tiny-gpt", src, dst, 64 * 1024, False, timeout_s=90)
    assert all(status == "ok" for status, *_ in results), results


def test_heterogeneous_multimodal_switch_is_exact() -> None:
    results = run_ranks(4, _switch, "tiny-vlm", "tp=2,dp=2", "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3",
                        16 * 1024, False, timeout_s=90)
    assert all(status == "ok" for status, *_ in results), results


def test_digest_names_a_corrupted_tensor() -> None:
    results = run_ranks(4, _switch, "tiny-gpt", "tp=2,dp=2,zero=1", "tp=4", 64 * 1024, True, timeout_s=90)
    statuses = {status for status, *_ in results}
    assert statuses == {"mismatch"}, results
    assert "verification failed for 1 tensor states" in results[0][1]
    assert "/exp_avg" in results[0][1]
    # The per-tensor rows (what the transition page lists) name the same one tensor and state.
    [(name, states)] = results[0][2]
    assert f"{name}/exp_avg" in results[0][1] and states == ["exp_avg"]


def test_the_digests_skip_exactly_the_state_a_switch_leaves_on_the_same_ranks() -> None:
    model = get_model("tiny-gpt")
    every = {(i, s) for i in range(len(model.tensors)) for s in ("param", "master", "exp_avg", "exp_avg_sq")}
    # Pure replicas: rank 0 counts every box before and after, and keeps it.
    assert unchanged_keys(plan_routes(model, "dp=2", "dp=4")) == every
    assert unchanged_keys(plan_routes(model, "dp=4", "dp=2")) == every
    # ZeRO-1 re-shards the optimizer over the new dp: only the bf16 params stay where they were.
    assert unchanged_keys(plan_routes(model, "dp=2,zero=1", "dp=4,zero=1")) == {k for k in every if k[1] == "param"}
    # A tensor-parallel change rewrites every TP-split tensor; replicated norms keep their params.
    assert unchanged_keys(plan_routes(model, "tp=2,dp=2,zero=1", "tp=4")) == {
        k for k in every if k[1] == "param" and model.tensors[k[0]].split.tp_dim is None}


def _mismatched_plan(rank: int, world: int):
    model = get_model("tiny-gpt")
    plan = plan_routes(model, "dp=2", "tp=2" if rank == 0 else "dp=2,zero=1")
    try:
        execute_plan(plan, rank, {})
    except EngineError as exc:
        return str(exc)
    return "no error"


def test_mismatched_plans_fail_before_moving_anything() -> None:
    results = run_ranks(2, _mismatched_plan, timeout_s=60)
    assert all("plan fingerprints differ" in r for r in results), results


def _dies_mid_switch(rank: int, world: int):
    import os

    model = get_model("tiny-gpt")
    plan = plan_routes(model, "tp=2,dp=2,zero=1", "tp=4", PlanOptions(staging_bytes=16 * 1024))
    old = {key: LocalShard(model.tensors[key[0]], key[1], box, truth(model, key, box))
           for key, box in rank_boxes(plan.src, rank).items()}

    def sample(label: str, live: int) -> None:
        if rank == 1 and label == "round 1 exchange":
            os._exit(3)  # a rank lost in the middle of the switch

    execute_plan(plan, rank, old, sample=sample)
    return "finished"


def test_a_rank_dying_mid_switch_fails_the_others_within_the_timeout() -> None:
    import time

    started = time.monotonic()
    with pytest.raises(EngineError) as failure:
        run_ranks(4, _dies_mid_switch, timeout_s=20)
    assert time.monotonic() - started < 60
    message = str(failure.value)
    assert "rank 1 died with exit code 3" in message or "[0, 1, 2, 3]" in message
    import re

    assert re.search(r"round \d+ of \d+ failed exchanging with ranks \[[^]]*1", message), message



def test_a_peer_lost_while_posting_a_round_is_named_as_in_the_exchange(monkeypatch) -> None:
    # gloo can fail the post itself (a send on a connection the dead peer reset) before any
    # wait; the survivor's error must still say which ranks the round exchanged with.
    from parallelism.engine import execute

    def reset(ops):
        raise RuntimeError("Connection reset by peer")

    monkeypatch.setattr(execute.dist, "batch_isend_irecv", reset)
    with pytest.raises(EngineError, match=r"rank 2: round 4 of 9 failed exchanging with ranks \[1, 3\] "
                                          r"\(posting transfers\): Connection reset by peer"):
        execute._post(["an op"], 2, 4, 9, [1, 3])
    assert execute._post([], 2, 4, 9, [1, 3]) == []  # nothing to post touches no peer
