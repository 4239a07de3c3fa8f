"""Real text for stack tests (issue 42): two packages of the standard library's source prepared
under a stack's data root and registered, and the check that a job read each sample once."""
from __future__ import annotations

import sysconfig
from pathlib import Path


def real_text_dataset(stack, name: str) -> Path:
    """The dataset directory `name` under the stack's data root, prepared and registered once."""
    from parallelism.datasets.prepare import prepare

    lib = Path(sysconfig.get_paths()["stdlib"])
    directory = stack.var_dir / "data" / name
    if not (directory / "dataset.json").exists():
        prepare([lib / "json", lib / "email"], directory, progress=False)
        stack.post("api/datasets", {"path": name})
    return directory


def assert_each_sample_read_once(job: dict, directory: Path, global_batch: int, seq: int) -> dict:
    """The ranks' records (agents/runtime/sample_log.py) of a stopped job: every step up to the
    job's last one recorded, each step's slices tiling its global batch exactly, and each digest
    that of the dataset's own samples (those an unswitched run reads). Returns step -> reads."""
    from agents.runtime.sample_log import consumed, gaps_and_repeats, read_records
    from parallelism.datasets.dataset import TokenDataset
    from parallelism.training.data import sample_digest

    records = read_records(job["checkpoint_dir"])
    reads = consumed(records)
    assert len(reads) == job["step"], (len(reads), job["step"])
    assert gaps_and_repeats(reads, global_batch) == []
    data = TokenDataset(directory, seq, seed=0)  # the control plane starts every job with seed 0
    for step, slices in reads.items():
        assert all(digest == sample_digest(data, first, n) for first, n, digest in slices), step
    return reads
