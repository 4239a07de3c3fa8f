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


def test_a_restore_discards_the_steps_after_its_checkpoint_whatever_layout_they_ran_in(tmp_path):
    """Steps 3-4 trained at dp=1, one rank of a dp=2 step 5 recorded before the stack stopped;
    restored from step 2 onto dp=2, the trajectory reads 3-4 again in two slices each."""
    old, new_a, new_b = (SampleLog(str(tmp_path), name) for name in ("old", "new-a", "new-b"))
    old.starts_at(0)
    for step in (1, 2, 3, 4):
        old.record(_result(step, (step - 1) * 8, 8), "dp=1")
    old.record(_result(5, 32, 4), "dp=2")  # half a step: its other rank died before recording
    for log in (new_a, new_b):
        log.starts_at(2)
    for step in (3, 4):
        new_a.record(_result(step, (step - 1) * 8, 4, "a"), "dp=2")
        new_b.record(_result(step, (step - 1) * 8 + 4, 4, "b"), "dp=2")
    reads = consumed(read_records(tmp_path))
    assert list(reads) == [1, 2, 3, 4] and gaps_and_repeats(reads, 8) == []
    assert reads[3] == [(16, 4, "a"), (20, 4, "b")]
    # without the markers the two attempts of step 3 overlap: the check would name it
    unmarked = [r for r in read_records(tmp_path) if "from" not in r]
    assert any(p.startswith("step 3:") for p in gaps_and_repeats(consumed(unmarked), 8))


def test_a_survivor_records_every_slice_of_the_last_step_it_completed_when_a_peer_is_lost(tmp_path, monkeypatch):
    """A peer lost right after a step's all-reduce may die before writing its own record (CI: an
    agent killed under a dp=3 job left step 8 without its slice). The survivors' update of that
    step summed the lost rank's gradient, so a survivor whose next step fails records every slice
    of it (train_loop.JobRounds.failed); equal reads collapse with the records the ranks wrote."""
    from agents.runtime import train_loop
    from parallelism.training import data

    monkeypatch.setattr(train_loop, "orphaned", lambda *args, **kwargs: None)
    monkeypatch.setattr(data, "sample_digest", lambda dataset, first, count: f"{first}+{count}")
    survivor = SampleLog(str(tmp_path), "node-1")
    for step in range(1, 9):  # dp=3, 4 samples a rank: ranks 0 and 1 wrote theirs, rank 2 only up to step 7
        for rank in (0, 1, 2)[: 3 if step < 8 else 2]:
            first = (step - 1) * 12 + rank * 4
            survivor.record(_result(step, first, 4, f"{first}+4"), "dp=3")
    rounds = train_loop.JobRounds.__new__(train_loop.JobRounds)
    rounds.samples, rounds.rank, rounds.reporter, rounds.settings = survivor, 0, None, None
    trainer = SimpleNamespace(trained=_result(8, 84, 4, "84+4"), ml=SimpleNamespace(dp=3), dp_rank=0, data=None,
                              placement=SimpleNamespace(layout="dp=3"))
    rounds.failed(trainer, RuntimeError("a peer is gone"), step_before=8)  # step 9 failed before its update
    reads = consumed(read_records(tmp_path))
    assert reads[8] == [(84, 4, "84+4"), (88, 4, "88+4"), (92, 4, "92+4")]
    assert gaps_and_repeats(reads, 12) == []
