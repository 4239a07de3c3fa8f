"""The record of what each rank read: one JSON line per trained step (step, the global samples it
read, their digest, the layout, the wall time), in a file of its own per rank process under the
job's checkpoint folder (shared storage, so it outlives nodes, restores and stack restarts).

A rank that starts training from a state at step S (a start, a restore from a checkpoint, a
survivor's or a joiner's world) first writes a marker `{"from": S}`: whatever any rank recorded
earlier for a step after S is off the trajectory the weights took (a restore discarded it), so
`consumed` drops it. Markers and records are ordered by wall time: a restore comes seconds after
the steps it discards, far above the skew of NTP-synced hosts. Reading every file back shows
whether the trajectory consumed each sample of its range once, in order."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

FOLDER = "samples"


class SampleLog:
    def __init__(self, checkpoint_dir: str, node: str) -> None:
        self.path = Path(checkpoint_dir) / FOLDER / f"{node}-{os.getpid()}.jsonl"
        self._file = None

    def starts_at(self, step: int) -> None:
        """This process trains on from a state at `step`: later steps recorded before are discarded."""
        self._write({"from": step})

    def record(self, result, layout: str) -> None:
        if result is None or result.samples < 1:
            return
        self._write({"step": result.step, "first": result.first_sample, "count": result.samples,
                     "digest": result.sample_digest, "layout": layout})

    def _write(self, line: dict) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # a line at a time
        self._file.write(json.dumps({**line, "t": time.time()}) + "\n")


def whole_batch(trainer, trained):
    """Every data rank's slice of a step this rank's update completed (StepResults-like): an update
    summed every data rank's gradient, so each of them read its slice, even one lost right after
    (whose own record never came). The slices are pure functions of the position."""
    from types import SimpleNamespace

    from parallelism.training.data import sample_digest

    per_dp, dp = trained.samples, trainer.ml.dp
    start = trained.first_sample - trainer.dp_rank * per_dp
    return [SimpleNamespace(step=trained.step, first_sample=start + d * per_dp, samples=per_dp,
                            sample_digest=sample_digest(trainer.data, start + d * per_dp, per_dp)) for d in range(dp)]


def read_records(checkpoint_dir: str | Path) -> list[dict]:
    out = []
    for path in sorted((Path(checkpoint_dir) / FOLDER).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def consumed(records: list[dict]) -> dict[int, list[tuple[int, int, str]]]:
    """step -> the distinct (first, count, digest) the trajectory read at that step, in sample
    order. Records are taken in time order; a `from` marker drops the steps after it recorded
    before it (a restore's discarded steps, in whatever layout they ran). Equal reads collapse: a
    lost rank's slice is recorded by itself and by its survivors (`whole_batch`)."""
    steps: dict[int, set] = {}
    for r in sorted(records, key=lambda r: r.get("t", 0.0)):
        if "from" in r:
            for step in [s for s in steps if s > r["from"]]:
                del steps[step]
        else:
            steps.setdefault(r["step"], set()).add((r["first"], r["count"], r["digest"]))
    return {step: sorted(reads) for step, reads in sorted(steps.items())}


def gaps_and_repeats(reads: dict[int, list[tuple[int, int, str]]], global_batch: int) -> list[str]:
    """Every way the reads break "each sample of the run's range once, in order": a step whose
    ranks' slices do not tile its global batch exactly, or a step missing."""
    problems = []
    for step, slices in reads.items():
        covered = [i for first, n, _ in slices for i in range(first, first + n)]
        expected = list(range((step - 1) * global_batch, step * global_batch))
        if covered != expected:
            problems.append(f"step {step}: read samples {covered[:3]}...{covered[-3:]} ({len(covered)}), "
                            f"expected {expected[0]}..{expected[-1]}")
    if reads:
        missing = sorted(set(range(1, max(reads) + 1)) - set(reads))
        if missing:
            problems.append(f"steps never recorded: {missing[:10]}")
    return problems
