"""Dataset directories for tests, written by the dataset library itself: `text_dataset` through
`prepare` (byte tokens, vocab 257), `token_dataset` through the IndexedWriter with a hand-written
manifest (any vocab, e.g. one larger than a model's); and, for stack tests (issue 42), real text
(two packages of the standard library's source prepared under a stack's data root and registered)
and the check that a job read each sample once."""
from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

TEXTS = ["def add(a, b):\n    return a + b\n" * 8, "class Point:\n    x: int = 0\n    y: int = 0\n" * 8,
         "import os\nprint(os.getcwd())\n" * 8, "for i in range(10):\n    print(i * i)\n" * 8]


def text_dataset(directory: Path, texts: list[str] = TEXTS, validation_fraction: float = 0.0,
                 name: str | None = None) -> Path:
    """`dynaplane data prepare` of one .py file per text into `directory` (byte tokens; a dataset
    already there is replaced)."""
    from parallelism.datasets.prepare import prepare

    source = directory.parent / f".{directory.name}-source"
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    for n, text in enumerate(texts):
        (source / f"doc{n:03d}.py").write_text(text)
    prepare([source], directory, validation_fraction=validation_fraction, name=name, force=True, progress=False)
    return directory


def token_dataset(directory: Path, documents: list[list[int]], vocab_size: int, name: str | None = None,
                  validation_fraction: float = 0.0) -> Path:
    """A Megatron indexed dataset of these token documents, its manifest saying `vocab_size`."""
    import numpy as np

    from parallelism.datasets.indexed import IndexedWriter
    from parallelism.datasets.manifest import Manifest, file_digest, write_manifest

    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size < 65_500 else np.int32
    with IndexedWriter(directory / "data", dtype) as writer:
        for doc in documents:
            writer.add(doc)
    fingerprint = file_digest([directory / "data.bin", directory / "data.idx"])
    write_manifest(Manifest(directory=directory, name=name or directory.name, format="megatron",
                            vocab_size=vocab_size, fingerprint=fingerprint, tokenizer={"kind": "hf"},
                            validation_fraction=validation_fraction, documents=len(documents),
                            tokens=sum(map(len, documents))))
    return directory


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
    problems = gaps_and_repeats(reads, global_batch)
    assert not problems, (problems, records)
    assert len(reads) == job["step"], (len(reads), job["step"], records)
    data = TokenDataset(directory, seq, seed=0)  # the control plane starts every job with seed 0
    for step, slices in reads.items():
        assert all(digest == sample_digest(data, first, n) for first, n, digest in slices), step
    return reads


def loss_steps(stack, job: dict) -> list:
    """The steps of the job's loss series (GET /api/jobs/{id}/live)."""
    return stack.get(f"api/jobs/{job['id']}/live", token=True)["metrics"].get("loss", {}).get("x", [])


def start_text_job(stack, name: str, *, gpus: int, global_batch: int, checkpoint_interval: int,
                   timeout: float = 120) -> dict:
    """A tiny-gpt job on the stack's real-text dataset (real_text_dataset), once it runs and has
    reported 3 steps: the job as GET /api/jobs/{id} gives it."""
    from tests.support.stack import wait_for

    real_text_dataset(stack, "stdlib-code")
    job = stack.post("api/jobs", {"name": name, "model": "tiny-gpt", "gpus": gpus, "global_batch": global_batch,
                                  "seq_len": 16, "checkpoint_interval": checkpoint_interval,
                                  "dataset": "stdlib-code"})
    running, _ = wait_for(lambda: (j := stack.get(f"api/jobs/{job['id']}", token=True))["state"] == "running"
                          and len(loss_steps(stack, job)) >= 3 and j, timeout=timeout)
    return running
