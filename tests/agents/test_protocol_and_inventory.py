"""Agent messages are closed and validated; inventory discovery is exact."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from agents import protocol
from agents.node.config import AgentConfig
from agents.node.heartbeat import build_heartbeat
from agents.node.inventory import InventoryError, parse_nvidia_smi, virtual_gpus


def _config(**overrides) -> AgentConfig:
    return AgentConfig(**{"name": "node-1", "gpus": 2, "device": "cpu", "broker_url": "redis://x", **overrides})


def test_heartbeat_round_trips_through_json() -> None:
    config = _config()
    beat = build_heartbeat(config, virtual_gpus(2, memory_bytes=2**30))
    again = protocol.AgentHeartbeat.model_validate(beat.model_dump(mode="json"))
    assert again == beat
    assert [g.index for g in again.gpus] == [0, 1]
    assert again.node == "node-1" and again.device == "cpu"


def test_heartbeat_rejects_unknown_fields_and_bad_names() -> None:
    good = build_heartbeat(_config(), virtual_gpus(1, memory_bytes=2**30)).model_dump(mode="json")
    with pytest.raises(ValidationError, match="extra"):
        protocol.AgentHeartbeat.model_validate({**good, "surprise": 1})
    with pytest.raises(ValidationError, match="DNS label"):
        protocol.AgentHeartbeat.model_validate({**good, "node": "Node_1"})
    dup = {**good, "gpus": [good["gpus"][0], good["gpus"][0]]}
    with pytest.raises(ValidationError, match="duplicate GPU indices"):
        protocol.AgentHeartbeat.model_validate(dup)


@pytest.mark.parametrize("name", ["node-1", "a", "gpu-host-07"])
def test_node_queue(name: str) -> None:
    assert protocol.node_queue(name) == f"node.{name}"


@pytest.mark.parametrize("name", ["", "-a", "a-", "A", "a.b", "x" * 64])
def test_bad_node_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="DNS label"):
        protocol.node_queue(name)
    with pytest.raises(ValueError):
        _config(name=name)


def test_virtual_inventory_splits_host_memory() -> None:
    gpus = virtual_gpus(4)
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert len({g.memory_bytes for g in gpus}) == 1 and gpus[0].memory_bytes > 0
    assert {g.model_name for g in gpus} == {"virtual-cpu"}


def test_cpu_agent_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="at least one virtual GPU"):
        _config(gpus=0)


def test_parse_nvidia_smi() -> None:
    text = "0, NVIDIA H100 80GB HBM3, 81559, GPU-aaaa\n1, NVIDIA H100 80GB HBM3, 81559, GPU-bbbb\n"
    gpus = parse_nvidia_smi(text)
    assert [(g.index, g.model_name, g.memory_bytes, g.uuid) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", 81559 * 2**20, "GPU-aaaa"),
        (1, "NVIDIA H100 80GB HBM3", 81559 * 2**20, "GPU-bbbb"),
    ]
    with pytest.raises(InventoryError, match="unexpected nvidia-smi line"):
        parse_nvidia_smi("0, H100\n")


def test_started_at_is_aware() -> None:
    assert _config().started_at.tzinfo is not None
    assert _config().started_at <= datetime.now(timezone.utc)


def test_a_heartbeat_says_what_the_node_runs() -> None:
    config = AgentConfig(name="node-1", device="cpu", gpus=2, broker_url="redis://x")
    beat = build_heartbeat(config, virtual_gpus(2, memory_bytes=2**30), lambda: ({7: [1, 0], 3: [2]}, (12, 5)))
    assert [(j.job_id, j.ranks) for j in beat.jobs] == [(3, (2,)), (7, (1, 0))]
    assert beat.emulations == (5, 12)
    assert protocol.AgentHeartbeat.model_validate_json(beat.model_dump_json()) == beat
    assert build_heartbeat(config, virtual_gpus(2, memory_bytes=2**30)).jobs == ()
    with pytest.raises(ValueError):
        protocol.RunningJob(job_id=1, ranks=(-1,))
