"""Job reports as the tests send them: each kind's required fields filled with what a
sender would put there unless the test gives them (protocol.JobReport is a tagged union:
a `started` report has a step, a `checkpoint` one its seconds, ...)."""
from __future__ import annotations

from datetime import datetime, timezone

from agents import protocol

DEFAULTS = {
    "started": {"step": 0},
    "step": {"loss": 1.0, "step_seconds": 0.1, "tokens_per_second": 1000.0},
    "checkpoint": {"checkpoint_path": "/checkpoints/step", "seconds": 0.1},
    "restored": {"checkpoint_path": "/checkpoints/restored", "seconds": 0.1, "verified": True},
}


def report_of(job_id: int, kind: str, node: str = "node-1", **fields) -> protocol.JobReport:
    return protocol.job_report(job_id=job_id, node=node, kind=kind, sent_at=datetime.now(timezone.utc),
                               **{**DEFAULTS.get(kind, {}), **fields})
