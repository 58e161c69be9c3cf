"""Rank 0's beats while it chooses a checkpoint (resume._Beats) follow its checksum reads, not
the clock: a read stuck on hung storage gives none, so the waiting ranks' watchdogs (and rank
0's own, whose I/O the beat writes would move) see the hang after the startup limit."""

from __future__ import annotations

import threading

import pytest

from pyrecover.checkpoint import checksum, entries, resume
from pyrecover.watchdog import Rule, Watchdog


class StuckFile:
    """A file whose first read returns a block and whose second hangs until `release` is set
    (as a read from hung storage does); `stuck` is set once it hangs. Then it ends."""

    def __init__(self) -> None:
        self.reads, self.stuck, self.release = 0, threading.Event(), threading.Event()

    def open(self, *_args, **_kwargs) -> StuckFile:
        return self

    def __enter__(self) -> StuckFile:
        return self

    def __exit__(self, *_exc) -> None:
        pass

    def read(self, _n: int) -> bytes:
        self.reads += 1
        if self.reads == 1:
            return b"x" * 4096
        if self.reads == 2:
            self.stuck.set()
            assert self.release.wait(60), "the test never released the read"
            return b"y" * 4096
        return b""


@pytest.mark.parametrize("checksum_of", [checksum.sha256_file, checksum.tree_file],
                         ids=["sha256_file", "tree_file"])
def test_a_stuck_checksum_read_gives_no_beat_and_one_that_advances_does(tmp_path, checksum_of):
    path = tmp_path / resume.VERIFYING
    beating = resume._Beats(path, every=3600.0)  # not started: the test calls `beat` itself
    assert not beating.beat() and not path.exists()  # nothing read yet: no beat
    file = StuckFile()
    reading = threading.Thread(target=checksum_of, args=(file,), daemon=True)
    reading.start()
    try:
        assert file.stuck.wait(60)  # the first block was read and counted; the second hangs
        assert beating.beat() and resume.beats(tmp_path) == 1
        for _ in range(3):  # however many intervals pass while the read hangs
            assert not beating.beat()
        assert resume.beats(tmp_path) == 1
    finally:
        file.release.set()
        reading.join(60)
    assert not reading.is_alive()
    assert beating.beat() and resume.beats(tmp_path) == 2  # the read moved on: a beat again
    assert not beating.beat()


def test_a_stuck_choice_gives_no_beats_and_the_waiting_rank_fires(tmp_path, monkeypatch):
    """The whole choice, beat thread and all, with a pick stuck before it reads a byte: the
    beat thread looks many times (waited for by count, not by time) and writes nothing, and a
    rank waiting for the choice takes it for a hang after the startup limit."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    release, looked = threading.Event(), threading.Event()
    monkeypatch.setattr(resume, "pick", lambda *a: (release.wait(120), resume.Choice(None))[1])
    monkeypatch.setattr(resume, "BEAT_S", 0.001)
    real_beat, looks = resume._Beats.beat, []

    def counted(self):
        wrote = real_beat(self)
        looks.append(wrote)
        if len(looks) >= 20:
            looked.set()
        return wrote

    monkeypatch.setattr(resume._Beats, "beat", counted)
    now = [1000.0]
    waiting = Watchdog(Rule(fixed=5, startup=60), rank=1, clock=lambda: now[0],
                       progress=lambda: resume.beats(root))
    waiting.phase("load")
    chosen = resume.choose_in_background(root, lambda *a, **k: None)
    try:
        assert looked.wait(60)
        assert not any(looks) and resume.beats(root) == 0
        assert waiting.check() is None
        now[0] += 61
        assert waiting.check().phase == "load"
    finally:
        release.set()
    assert chosen.result(timeout=60).found is None
    assert not (root / resume.VERIFYING).exists()


def test_removing_a_killed_save_s_files_beats_and_leaves_nothing(tmp_path):
    """tidy removes what a killed save left (a large DCP save: thousands of files, slow on a
    parallel file system); each removal is progress, so the waiting ranks do not take a long
    tidy for a hang."""
    root = tmp_path / "checkpoints"
    left = root / ".tmp-step-40-abc"
    (left / "shards").mkdir(parents=True)
    for i in range(5):
        (left / "shards" / f"__{i}_0.distcp").write_bytes(b"x")
    (root / "elsewhere").mkdir()
    (left / "link").symlink_to(root / "elsewhere", target_is_directory=True)  # not followed
    (root / "step-30").mkdir()
    beating = resume._Beats(tmp_path / resume.VERIFYING, every=3600.0)
    assert entries.clean_uncommitted(root) == [left]
    assert beating.beat() and not beating.beat()  # moved once for the removals, then still
    assert sorted(p.name for p in root.iterdir()) == ["elsewhere", "step-30"]
