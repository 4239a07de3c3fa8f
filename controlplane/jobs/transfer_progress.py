"""Pure merging of a transition's live transfer progress (protocol.TransferProgress) into
what the Transition row keeps (Transition.progress): reports travel through a thread pool
and may arrive out of order, so the furthest round and each rank's longest measured wave
win, whatever the order."""
from __future__ import annotations

from agents import protocol


def merge_progress(stored: dict, report: protocol.TransferProgress) -> dict:
    """Transition.progress after one more report: {round, rounds, moved_bytes, waves
    {"rank": [bytes...]}} (JSON object keys are strings)."""
    waves = {str(rank): list(wave) for rank, wave in (stored.get("waves") or {}).items()}
    for rank, wave in report.waves.items():
        if len(wave) >= len(waves.get(str(rank), ())):
            waves[str(rank)] = list(wave)
    newer = report.round >= stored.get("round", -1)
    return {
        "round": max(report.round, stored.get("round", 0)),
        "rounds": report.rounds if newer or "rounds" not in stored else stored["rounds"],
        "moved_bytes": max(report.moved_bytes, stored.get("moved_bytes", 0)),
        "waves": dict(sorted(waves.items(), key=lambda item: int(item[0]))),
    }
