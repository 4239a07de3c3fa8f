"""The sample record: ranks' lines read back, and every break of "each sample once, in order" named."""
from __future__ import annotations

from types import SimpleNamespace

from agents.runtime.sample_log import SampleLog, consumed, gaps_and_repeats, read_records


def _result(step, first, count, digest="d"):
    return SimpleNamespace(step=step, first_sample=first, samples=count, sample_digest=digest)


def test_records_from_several_rank_processes_tile_the_batches(tmp_path):
    a, b = SampleLog(str(tmp_path), "node-1"), SampleLog(str(tmp_path), "node-2")
    b.path = b.path.with_name("node-2-other.jsonl")  # another process
    for step in (1, 2):
        a.record(_result(step, (step - 1) * 8, 4), "dp=2")
        b.record(_result(step, (step - 1) * 8 + 4, 4), "dp=2")
    a.record(_result(3, 16, 8), "dp=1")
    a.record(_result(3, 16, 8), "dp=1")  # retrained after a restore: the same read
    reads = consumed(read_records(tmp_path))
    assert list(reads) == [1, 2, 3] and gaps_and_repeats(reads, 8) == []


def test_a_repeat_a_skip_and_a_missing_step_are_named(tmp_path):
    log = SampleLog(str(tmp_path), "n")
    log.record(_result(1, 0, 8), "dp=1")
    log.record(_result(2, 7, 8), "dp=1")  # starts one sample early: sample 7 twice, 15 skipped
    log.record(_result(4, 24, 8), "dp=1")
    problems = gaps_and_repeats(consumed(read_records(tmp_path)), 8)
    assert problems[0].startswith("step 2: read samples [7, 8, 9]") and problems[-1] == "steps never recorded: [3]"
    log.record(_result(4, 24, 8, digest="other"), "dp=1")  # a retrained step that read other samples
    assert any(p.startswith("step 4:") for p in gaps_and_repeats(consumed(read_records(tmp_path)), 8))
