"""The run folder an agent shares with its job's rank processes: the names of the files
each side leaves for the other (the agent's stop and switch orders, the ranks' markers).
Both sides import this, and only this, of each other."""
from __future__ import annotations

from pathlib import Path

STOP_FILE = "stop"


def switch_file(transition_id: int) -> str:
    return f"switch-{transition_id}.json"


def transferring_marker(transition_id: int, rank: int) -> str:
    """The file a joining rank leaves once it is in the union world: from then on the old
    ranks roll the switch back if it dies (rank 0 reports it), nobody else has to."""
    return f"transferring-{transition_id}-rank-{rank}"


def switched_marker(transition_id: int, rank: int) -> str:
    """The file a joining rank leaves in its run folder once the switch has moved its state
    (its agent then treats its death as the job's failure, no longer as an aborted switch)."""
    return f"switched-{transition_id}-rank-{rank}"


def done_switches(run_dir: Path) -> set[int]:
    """Switch orders already in the run folder: all finished (a recovery runs only when no
    transition was active), so the recovered world's rank 0 must not take them up again."""
    return {int(p.stem.split("-", 1)[1]) for p in run_dir.glob("switch-*.json") if p.stem.split("-", 1)[1].isdigit()}


def orphan_marker(rank: int) -> str:
    """The file an orphaned rank leaves with its step and error (orphan.py); its agent reports it."""
    return f"orphaned-rank-{rank}.json"


def recover_file(restore_id: int) -> str:
    """The JobRecoverOrder the agent writes for its orphaned ranks."""
    return f"recover-{restore_id}.json"


def renumbered_marker(order_file: str) -> str:
    """The file a rank of the new layout leaves in its run folder once a switch (order file
    `order_file`: a switch or a recovery order) whose device map gave ranks other processes
    has built its new trainer, past the switch's last point of rollback: its agent then
    renumbers the job's processes there by that order's map."""
    return f"renumbered-{order_file}"
