"""`pyrecover demo`, the README's first command (`make demo`), as a new user runs it."""

from __future__ import annotations

import re

from helpers import pyrecover

from pyrecover.rundir import read_jsonl


def test_the_demo_kills_its_run_resumes_it_and_the_loss_keeps_falling(tmp_path):
    done = pyrecover("demo", "--workdir", str(tmp_path), timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    killed = re.search(r"SIGKILL sent to the whole process group at step (\d+); the last "
                       r"committed checkpoint is step (\d+)", done.stdout)
    assert killed is not None, done.stdout[-3000:]
    killed_at, last_ckpt = int(killed[1]), int(killed[2])
    assert 0 < last_ckpt <= killed_at

    events = list(read_jsonl(tmp_path / "local-demo" / "events.jsonl"))
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["step"] == last_ckpt  # the newest committed checkpoint, nothing older
    assert [e["step"] for e in events if e["event"] == "finish"] == [300]
    assert f"resumed from {resume['path']} (step {last_ckpt})" in done.stdout
    # The demo itself fails unless the loss fell from the start to the kill and on to the end.
    summary = re.search(r"loss: step \d+ ([\d.]+) -> step \d+ \(killed\) ([\d.]+) -> step 300 "
                        r"\(finished\) ([\d.]+)", done.stdout)
    assert summary is not None, done.stdout[-3000:]
    first, before, last = map(float, summary.groups())
    assert last < before < first
