"""Resize proposals and plan preview: the pure maths (proposals.py, plan_preview.py) and
the read-only endpoints GET /api/jobs/{id}/proposals and /plan, /api/transitions/{id}/plan."""
from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.reports import report_of
from parallelism.layout.catalog import get_model
from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import place
from parallelism.planner.plan import PlanOptions, plan_routes
from parallelism.layout.shards import STATE_CLASS, full_box, holder_boxes
from parallelism.layout.tensors import STATE_BYTES, STATES
from controlplane.jobs.plan_preview import plan_preview, route_matrix
from parallelism.layout.job_memory import state_bytes_per_rank
from controlplane.jobs.proposals import propose

TINY = get_model("tiny-gpt")


def _shard_bytes(placement, rank: int) -> int:
    """The oracle: every (tensor, state) box the rank holds, as docs/contracts.md section 3's
    shard records (offsets, lengths), summed in bytes."""
    total = 0
    for tensor in placement.model.tensors:
        for state in STATES:
            boxes = holder_boxes(placement, tensor, STATE_CLASS[state])
            hit = np.searchsorted(boxes.rank, rank)
            if hit < len(boxes.rank) and boxes.rank[hit] == rank:
                _, lengths = full_box(tensor, boxes.a0[hit], boxes.a1[hit], boxes.b0[hit], boxes.b1[hit])
                total += int(np.prod(lengths)) * STATE_BYTES[state]
    return total


def test_state_bytes_per_rank_matches_the_shards_each_rank_holds() -> None:
    placement = place(TINY, "tp=2,pp=2,dp=2,zero=1")
    fast = state_bytes_per_rank(placement)
    for rank in range(placement.world):
        assert fast[rank] == _shard_bytes(placement, rank), rank


def test_dp_only_grow_is_ranked_first_with_the_scaled_step_time() -> None:
    ranked = propose(TINY, current_layout="dp=2", gpus=4, global_batch=12, micro_batch=1, seq_len=16,
                     capacity_bytes=2**30, step_seconds=0.2)
    assert ranked[0].layout == "dp=4" and ranked[0].step_seconds == pytest.approx(0.1)
    assert ranked[0].tokens_per_second == pytest.approx(12 * 16 / 0.1)
    assert all(p.world == 4 and p.tp * p.pp * p.dp == 4 for p in ranked)
    pipelined = next(p for p in ranked if p.layout == "pp=2,dp=2")
    assert pipelined.step_seconds == pytest.approx(0.2 * 2 / 4 * 7 / 6)  # 6 micro-batches: bubble 7/6
    times = [p.step_seconds for p in ranked]
    assert times == sorted(times)


def test_a_layout_that_does_not_fit_comes_last_and_says_so() -> None:
    capacity = int(state_bytes_per_rank(place(TINY, "tp=2,dp=2")).max())  # dp=4 holds more per GPU
    ranked = propose(TINY, current_layout="dp=2", gpus=4, global_batch=12, micro_batch=1, seq_len=16,
                     capacity_bytes=capacity, step_seconds=None)
    assert not next(p for p in ranked if p.layout == "dp=4").fits
    fits = [p.fits for p in ranked]
    assert fits == sorted(fits, reverse=True) and fits[0]
    assert all(p.step_seconds is None and p.tokens_per_second is None for p in ranked)


def test_tensor_parallelism_beyond_the_kv_heads_is_proposed_where_the_trainer_replicates_them() -> None:
    assert TINY.modules[0].num_kv_heads == 2
    ranked = propose(TINY, current_layout="dp=2", gpus=4, global_batch=12, micro_batch=1, seq_len=16,
                     capacity_bytes=None, step_seconds=None)
    assert {p.layout for p in ranked} == {"dp=4", "tp=2,dp=2", "tp=2,pp=2", "pp=2,dp=2", "pp=4", "tp=4"}


def test_the_batch_rule_filters_data_parallel_degrees() -> None:
    ranked = propose(TINY, current_layout="dp=2", gpus=4, global_batch=2, micro_batch=1, seq_len=16,
                     capacity_bytes=None, step_seconds=None)
    assert ranked and all(2 % p.dp == 0 for p in ranked)
    assert "dp=4" not in {p.layout for p in ranked}


def test_heterogeneous_layouts_are_refused_with_the_reason() -> None:
    model = get_model("tiny-gpt")
    with pytest.raises(LayoutError, match="single-module"):
        propose(model, current_layout="dp=2,ranks=0-1", gpus=4, global_batch=8, micro_batch=1, seq_len=16,
                capacity_bytes=None, step_seconds=None)


@settings(max_examples=25, deadline=None)
@given(gpus=st.integers(1, 12), batch=st.sampled_from([1, 4, 12, 24]))
def test_every_proposal_is_a_valid_layout_of_the_asked_size(gpus: int, batch: int) -> None:
    for p in propose(TINY, current_layout="dp=2", gpus=gpus, global_batch=batch, micro_batch=1, seq_len=8,
                     capacity_bytes=None, step_seconds=1.0):
        assert place(TINY, p.layout).world == gpus
        assert batch % p.dp == 0 and p.fits and p.step_seconds > 0
        assert p.tp in (1, 2, 4)  # divides the 4 heads; beyond the 2 kv heads they are replicated


@pytest.mark.parametrize("src,dst", [("dp=2", "dp=4"), ("dp=4", "tp=2,dp=2"), ("tp=2,pp=2", "dp=3")])
def test_plan_preview_numbers_agree_with_the_plan(src: str, dst: str) -> None:
    data = plan_preview(TINY, src, dst, gpus_per_node=2, staging_bytes=2**20)
    summary = data["summary"]
    matrix = np.array(data["matrix"])
    assert matrix.shape == (data["world"], data["world"]) and np.trace(matrix) == 0
    assert matrix.sum() == summary["network_bytes"] == sum(data["round_bytes"])
    assert len(data["round_bytes"]) == summary["rounds"] == len(data["wave_peak"]) == len(data["wave_after"]) - 1
    assert np.max(data["wave_peak"]) == summary["predicted_peak_bytes"]
    assert sum(data["round_seconds"]) == pytest.approx(data["estimated_seconds"])
    # Rows and columns are the union world's processes (the device map gives ranks processes).
    plan = plan_routes(TINY, src, dst, PlanOptions(gpus_per_node=2, staging_bytes=2**20, map_ranks=True))
    assert summary["fingerprint"] == plan.fingerprint and (route_matrix(plan) == matrix).all()
    src_world = place(TINY, src).world
    leaving = [p for p in range(plan.world) if plan.dst_rank(p) is None]
    assert np.array(data["wave_after"])[0, src_world:].sum() == 0  # joining processes start empty
    assert np.array(data["wave_after"])[-1, leaving].sum() == 0  # leaving processes end empty
    assert summary["network_bytes"] <= summary["contract_order_network_bytes"]


# --- the endpoints ------------------------------------------------------------------------

def _running(run, token_client, **body) -> dict:
    from controlplane.jobs.reports import job_record_report

    response = run(token_client.post, "/api/jobs", {"name": "p", "model": "tiny-gpt", "global_batch": 12, **body},
                   format="json")
    assert response.status_code == 201, response.content
    job = response.json()
    run(job_record_report, report=report_of(job["id"], "started"))
    return job


@pytest.mark.django_db
def test_proposals_endpoint_ranks_layouts_with_the_measured_step_time(run, token_client, two_nodes, sent_tasks) -> None:
    from controlplane.jobs.models import Job
    from controlplane.jobs.services import metrics_append, metrics_series_get

    job = _running(run, token_client, gpus=2)
    before = token_client.get(f"/api/jobs/{job['id']}/proposals?gpus=4").json()
    assert before["measured_step_seconds"] is None and before["proposals"][0]["step_seconds"] is None
    series = metrics_series_get(job=Job.objects.get(pk=job["id"]), name="step_seconds", unit="s")
    metrics_append(series_id=series.pk, xs=[1, 2, 3, 4, 5, 6], ys=[9.0, 0.3, 0.2, 0.2, 0.2, 0.4])
    body = token_client.get(f"/api/jobs/{job['id']}/proposals?gpus=4").json()
    assert body["measured_step_seconds"] == pytest.approx(0.2)  # median of the last five
    assert body["capacity_bytes"] == 16 * 2**30 and body["predictor"] == "rule" and "emulator" in body["ranking"]
    assert body["default_layout"] == "dp=4" and body["proposals"][0]["layout"] == "dp=4"
    assert body["proposals"][0]["step_seconds"] == pytest.approx(0.1) and body["proposals"][0]["fits"] is True


@pytest.mark.django_db
def test_proposals_and_plan_reject_bad_input_by_name(run, token_client, two_nodes, sent_tasks) -> None:
    job = _running(run, token_client, gpus=2)
    for query in ("", "?gpus=0", "?gpus=x"):
        response = token_client.get(f"/api/jobs/{job['id']}/proposals{query}")
        assert response.status_code == 400 and "gpus" in response.json(), response.content
    response = token_client.get(f"/api/jobs/{job['id']}/proposals?gpus=7")  # 12 % 7: no dp works, 7 is prime
    assert response.status_code == 400 and "no layout of tiny-gpt spans 7 GPUs" in str(response.json())
    response = token_client.get(f"/api/jobs/{job['id']}/plan?layout=tp=3")
    assert response.status_code == 400 and "cannot be planned" in str(response.json()), response.content
    assert token_client.get(f"/api/jobs/{job['id']}/plan").status_code == 400


@pytest.mark.django_db
def test_plan_preview_is_the_plan_the_resize_then_records(run, token_client, two_nodes, sent_tasks) -> None:
    job = _running(run, token_client, gpus=2)
    preview = token_client.get(f"/api/jobs/{job['id']}/plan?layout=dp=4").json()
    assert preview["source_layout"] == "dp=2" and preview["destination_layout"] == "dp=4" and preview["world"] == 4
    transition = run(token_client.post, f"/api/jobs/{job['id']}/resize", {"layout": "dp=4"}, format="json").json()
    assert transition["plan_fingerprint"] == preview["summary"]["fingerprint"]
    recorded = token_client.get(f"/api/transitions/{transition['id']}/plan").json()
    assert recorded["summary"]["fingerprint"] == transition["plan_fingerprint"]
    assert recorded["matrix"] == preview["matrix"]


def test_reconcile_gives_one_prediction_and_says_where_it_comes_from() -> None:
    from controlplane.jobs.proposals import reconcile

    emulated = {"step_seconds": 0.01, "gpu_type": "h100"}
    both = reconcile({"layout": "dp=4", "step_seconds": 0.36}, emulated)
    assert (both["predicted_step_seconds"], both["predicted_from"]) == (0.36, "measured")
    assert both["measured_over_emulated"] == pytest.approx(36.0) and both["emulated"] == emulated
    only_emulated = reconcile({"layout": "dp=4", "step_seconds": None}, emulated)
    assert (only_emulated["predicted_step_seconds"], only_emulated["predicted_from"]) == (0.01, "emulated")
    assert only_emulated["measured_over_emulated"] is None
    assert reconcile({"layout": "dp=4", "step_seconds": None}, None)["predicted_from"] is None


@pytest.mark.django_db
def test_proposals_use_the_steps_of_the_current_layout_and_a_finished_emulation(run, token_client, two_nodes,
                                                                              sent_tasks) -> None:
    from django.utils import timezone

    from controlplane.emulation.models import EmulationRun
    from controlplane.jobs.models import Job, Transition
    from controlplane.jobs.services import metrics_append, metrics_series_get

    job = _running(run, token_client, gpus=2)
    row = Job.objects.get(pk=job["id"])
    series = metrics_series_get(job=row, name="step_seconds", unit="s")
    # Steps 1-6 on the old layout, a switch committed at step 6, then steps on dp=2.
    metrics_append(series_id=series.pk, xs=[1, 2, 3, 4, 5, 6, 7, 8, 9], ys=[5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 0.4, 0.2, 0.2])
    Transition.objects.create(job=row, source_layout="dp=1", destination_layout="dp=2", source_world=1,
                              destination_world=2, state="committed", step=6)
    result = {"step_seconds": 0.001, "tokens_per_second": 12000.0, "memory": {"peak_bytes": 2**20}}
    for layout, gpu in (("dp=4", "h100"), ("tp=1,pp=1,dp=4", "a100")):  # the newest of the same layout wins
        EmulationRun.objects.create(model="tiny-gpt", layout=layout, gpus=4, gpu_type=gpu, global_batch=12,
                                    micro_batch=1, seq_len=row.seq_len, state="done", result=result,
                                    finished_at=timezone.now())
    EmulationRun.objects.create(model="tiny-gpt", layout="tp=2,dp=2", gpus=4, gpu_type="h100", global_batch=99,
                                micro_batch=1, seq_len=row.seq_len, state="done", result=result,
                                finished_at=timezone.now())  # another batch: not this job's setting
    body = token_client.get(f"/api/jobs/{job['id']}/proposals?gpus=4").json()
    assert body["measured_step_seconds"] == pytest.approx(0.2) and body["recent_steps"] == 5  # dp=2's steps only
    by_layout = {p["layout"]: p for p in body["proposals"]}
    dp4 = by_layout["dp=4"]
    assert dp4["predicted_from"] == "measured" and dp4["predicted_step_seconds"] == pytest.approx(0.1)
    assert dp4["emulated"]["gpu_type"] == "a100" and dp4["emulated"]["fits"] is True
    assert dp4["measured_over_emulated"] == pytest.approx(100.0)
    assert all(p["emulated"] is None for name, p in by_layout.items() if name != "dp=4")


def test_the_kept_state_bytes_are_the_placements_own_for_every_layout() -> None:
    """proposals.most_state_bytes keeps a (model, layout)'s answer for the sweeps that follow; the
    oracle is the computation itself on a fresh placement, asked twice (kept, then from the store)."""
    from parallelism.layout.job_memory import state_bytes_per_rank
    from controlplane.jobs.proposals import most_state_bytes

    model = get_model("tiny-gpt")
    for layout in ("dp=4", "tp=2,dp=2", "tp=2,pp=2,zero=1", "pp=2,dp=2,zero=3"):
        expected = int(state_bytes_per_rank(place(model, layout)).max())
        assert most_state_bytes(place(model, layout)) == expected
        assert most_state_bytes(place(get_model("tiny-gpt"), layout)) == expected  # (an equal model: the store)
