"""The compare page's configurations for a multimodal model (issue 8): POST /api/emulations
accepts homogeneous, colocated and non-colocated layouts of tiny-vlm, and names what is
wrong with a per-module layout (module names, GPU count, the batch cut over the LLM's dp)."""
from __future__ import annotations

import pytest

from tests.controlplane.test_emulations import emulate_orders, emulate_queue  # noqa: F401  (the real broker's queue)

CONFIG = {"model": "tiny-vlm", "gpus": 4, "gpu_type": "h100", "global_batch": 8, "micro_batch": 1, "seq_len": 32}


@pytest.mark.django_db(transaction=True)
def test_heterogeneous_layouts_are_queued(token_client, emulate_queue) -> None:  # noqa: F811
    layouts = ["tp=2,dp=2", "encoder:dp=4;llm:tp=2,dp=2", "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3"]
    response = token_client.post("/api/emulations", {"configs": [{**CONFIG, "layout": l} for l in layouts]},
                                 format="json")
    assert response.status_code == 201, response.json()
    assert [r["layout"] for r in response.json()["runs"]] == layouts
    assert sorted(o["layout"] for o in emulate_orders(emulate_queue)) == sorted(layouts)


@pytest.mark.django_db
@pytest.mark.parametrize("layout,message", [
    ("vision:dp=2;llm:dp=2", "has modules ['encoder', 'llm']"),
    ("encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-4", "ranks=2-4 holds 3 ranks but tp*pp*dp*cp=2"),
    ("encoder:dp=2,ranks=0-1;llm:dp=3,ranks=2-4", "needs 5 GPUs, not 4"),
    ("encoder:dp=1,ranks=0-0;llm:dp=3,ranks=1-3", "is not a multiple of micro_batch=1 x dp=3"),
])
def test_a_bad_heterogeneous_configuration_is_named(token_client, layout, message) -> None:
    response = token_client.post("/api/emulations", {"configs": [{**CONFIG, "layout": layout}]}, format="json")
    assert response.status_code == 400
    assert message in " ".join(response.json()["configs[0]"]), response.json()
