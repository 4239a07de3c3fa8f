"""A job's elastic settings through the API: the switch, the GPU range and the priority;
their rules (400 naming the field and the rule), defaults, and the OpenAPI schema."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from controlplane.cluster import services as cluster
from controlplane.jobs.elastic_range import range_problems
from controlplane.jobs.models import Job
from tests.controlplane.conftest import heartbeat

pytestmark = pytest.mark.django_db


@pytest.fixture
def four_gpus(db) -> None:
    for i in (1, 2):
        cluster.node_record_heartbeat(report=heartbeat(f"node-{i}", gpus=2, host=f"host-{i}"))


def create(client, **fields):
    body = {"name": "j", "model": "tiny-gpt", "gpus": 2, "start": False, **fields}
    return client.post("/api/jobs", body, format="json")


def test_a_job_is_not_elastic_unless_asked_and_its_range_defaults_to_its_gpus(token_client, four_gpus) -> None:
    body = create(token_client).json()
    assert (body["elastic"], body["min_gpus"], body["max_gpus"], body["priority"]) == (False, None, None, 0)
    assert Job.objects.get(pk=body["id"]).gpu_range == (2, 2)


def test_an_elastic_job_is_created_with_its_range_and_priority(token_client, four_gpus) -> None:
    response = create(token_client, elastic=True, min_gpus=1, max_gpus=4, priority=7)
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.elastic, job.gpu_range, job.priority) == (True, (1, 4), 7)
    checked = token_client.post("/api/jobs/validate", {"name": "k", "model": "tiny-gpt", "gpus": 2, "elastic": True,
                                                       "max_gpus": 4}, format="json")
    assert checked.status_code == 200 and checked.json()["max_gpus"] == 4


@pytest.mark.parametrize("fields, field, fragment", [
    ({"min_gpus": 3, "max_gpus": 4}, "min_gpus", "min_gpus=3 is above the 2 GPUs the job runs on"),
    ({"max_gpus": 1}, "max_gpus", "max_gpus=1 is below the 2 GPUs the job runs on"),
    ({"min_gpus": 2, "max_gpus": 1}, "max_gpus", "max_gpus=1 is below min_gpus=2"),
    ({"max_gpus": 64}, "max_gpus", "max_gpus=64 exceeds the cluster's 4 GPUs"),
    ({"max_gpus": 0}, "max_gpus", "greater than or equal to 1"),
    ({"min_gpus": "two"}, "min_gpus", "valid integer"),
    ({"priority": 2**31}, "priority", "less than or equal to 2147483647"),
    ({"elastic": "maybe"}, "elastic", "valid boolean"),
])
def test_a_bad_range_is_a_400_naming_the_field(token_client, four_gpus, fields, field, fragment) -> None:
    response = create(token_client, **fields)
    assert response.status_code == 400, response.content
    assert fragment in " ".join(response.json()[field])
    assert not Job.objects.exists()


def test_patch_changes_the_settings_and_refuses_a_range_that_leaves_the_job_out(token_client, four_gpus) -> None:
    job_id = create(token_client).json()["id"]
    url = f"/api/jobs/{job_id}/elastic"
    changed = token_client.patch(url, {"elastic": True, "max_gpus": 4, "priority": 3}, format="json")
    assert changed.status_code == 200, changed.content
    assert {k: changed.json()[k] for k in ("elastic", "min_gpus", "max_gpus", "priority")} == \
        {"elastic": True, "min_gpus": None, "max_gpus": 4, "priority": 3}
    refused = token_client.patch(url, {"min_gpus": 3}, format="json")
    assert refused.status_code == 400
    assert refused.json() == {"min_gpus": ["min_gpus=3 is above the 2 GPUs the job runs on (world_size); the range "
                                           "must hold them"]}
    assert Job.objects.get(pk=job_id).min_gpus is None  # nothing written
    assert token_client.patch(url, {}, format="json").json() == {
        "elastic": ["give at least one of elastic, min_gpus, max_gpus, priority"]}
    off = token_client.patch(url, {"elastic": False}, format="json").json()
    assert (off["elastic"], off["max_gpus"]) == (False, 4)
    assert APIClient().patch(url, {"elastic": True}, format="json").status_code == 401
    assert token_client.patch("/api/jobs/99999/elastic", {"elastic": True}, format="json").status_code == 404


def test_the_schema_shows_the_elastic_settings() -> None:
    schema = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert "patch" in schema["paths"]["/api/jobs/{id}/elastic"]
    components = schema["components"]["schemas"]
    for name in ("Job", "JobCreate", "PatchedJobElastic"):  # (drf-spectacular names a PATCH body "Patched...")
        assert {"elastic", "min_gpus", "max_gpus", "priority"} <= set(components[name]["properties"]), name


def test_the_range_rule_without_an_inventory_checks_only_the_job_itself() -> None:
    assert range_problems(min_gpus=None, max_gpus=512, world_size=8, cluster_gpus=0) == {}
    assert range_problems(min_gpus=None, max_gpus=None, world_size=8, cluster_gpus=4) == {}  # gpus' own rule
    assert range_problems(min_gpus=None, max_gpus=8, world_size=8, cluster_gpus=4) == {
        "max_gpus": ["max_gpus=8 exceeds the cluster's 4 GPUs"]}


@given(st.one_of(st.none(), st.integers(1, 64)), st.one_of(st.none(), st.integers(1, 64)), st.integers(1, 64),
       st.sampled_from([0, 16, 64]))
def test_a_range_passes_exactly_when_it_holds_the_job_and_fits_the_cluster(lo, hi, world, cluster) -> None:
    low, high = (world if lo is None else lo), (world if hi is None else hi)
    fits = not cluster or hi is None or hi <= cluster
    problems = range_problems(min_gpus=lo, max_gpus=hi, world_size=world, cluster_gpus=cluster)
    assert (problems == {}) == (low <= world <= high and fits)
    assert set(problems) <= {"min_gpus", "max_gpus"}
