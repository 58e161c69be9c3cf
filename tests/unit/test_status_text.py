"""`pyrecover status`'s text reads as the rest of the CLI does: a checkpoint's size and age in
`ckpt ls`'s units, and no figure printed as minus zero."""

from __future__ import annotations

import dataclasses
import random

from pyrecover import status, status_text
from pyrecover.checkpoint import listing, store
from pyrecover.rundir import RunDir


def _run_with_a_checkpoint(tmp_path, size: int) -> tuple[RunDir, float]:
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0)
    pending = store.begin(run.checkpoints, 10)
    with pending.open("state.pt") as f:
        f.write(b"x" * size)
    folder = pending.commit("vanilla", 1, {"step": 10})
    return run, store.read_manifest(folder)["time"]


def test_a_checkpoint_s_size_and_age_read_as_ckpt_ls_prints_them(tmp_path):
    """Hours-old 1.5 GB checkpoints said `1500.0 MB, 20308s old`; ckpt ls said `1.5 GB`, `5.6h`."""
    run, saved = _run_with_a_checkpoint(tmp_path, 3000)
    for age in (0.0, 42.0, 20308.0, 3 * 86400.0):
        s = status.read(run.root, now=saved + age)
        (row,) = listing.list_checkpoints(run, checksums=False, now=saved + age)
        line = next(x for x in status_text.render(s).splitlines()
                    if x.startswith("checkpoint  "))
        assert (f"step 10 (vanilla, {listing.human_bytes(row.size)}, "
                f"{listing.human_age(row.age_s)} old;") in line, line


def test_no_ledger_row_prints_minus_zero_whatever_the_rounding_left_over(tmp_path):
    """The remainder takes the other causes' rounding, a few milliseconds either way."""
    run, _ = _run_with_a_checkpoint(tmp_path, 10)
    s = status.read(run.root)
    rng = random.Random(7)
    causes = ("queue_wait", "start_up", "restore", "checkpoint_stall", "lost_work",
              "productive", "idle", "remainder")
    for _ in range(200):
        book = {k: round(rng.uniform(0, 50), 3) for k in causes}
        book["remainder"] = rng.choice([-0.004, -0.001, -0.0004, 0.0, 0.0004, 0.003])
        wall = round(sum(book.values()), 3)
        ledger = {"wall_seconds": wall, "launched_seconds": wall - book["idle"],
                  "effective_share": book["productive"] / (wall - book["idle"]),
                  "queue_from_slurm": True, "causes": book}
        text = status_text.render(dataclasses.replace(s, ledger=ledger, job_id=None))
        rows = [x for x in text.splitlines() if x.startswith("  remainder")]
        assert rows and "-0.0" not in rows[0], rows
        assert rows[0].split()[1:] == ["0.0s", "0.0%"], rows


def test_a_run_that_saved_nothing_says_so_on_its_saves_line(tmp_path):
    """The `saves` line: what checkpoints cost the loop (the ledger's checkpoint stall) and
    their write time apart, or `none` for a run that has neither."""
    run, _ = _run_with_a_checkpoint(tmp_path, 10)  # (a folder committed by hand: no event)
    s = status.read(run.root)
    assert "saves       none" in status_text.render(s).splitlines()
    text = status_text.render(dataclasses.replace(s, checkpoint_stall_seconds=0.26,
                                                  checkpoint_write_seconds=3.04))
    (line,) = [x for x in text.splitlines() if x.startswith("saves ")]
    assert line.startswith("saves       loop blocked 0.3s (the checkpoint stall below")
    assert "; 3.0s writing (each save's start to commit" in line


def test_a_run_past_its_recorded_max_steps_says_a_start_ends_at_once_not_step_100_of_30(tmp_path):
    """A finished run at step 100 launched again with tiny.yaml (max_steps 30, now in run.yaml)
    read `progress    step 100 of 30`, as if the count had gone wrong."""
    run, saved = _run_with_a_checkpoint(tmp_path, 10)
    s = dataclasses.replace(status.read(run.root, now=saved), step=100, max_steps=30)
    (line,) = [x for x in status_text.render(s).splitlines() if x.startswith("progress")]
    assert line == ("progress    step 100, past train.max_steps=30 (run.yaml): a start ends at "
                    "once; --set train.max_steps=N to train on")
    s = dataclasses.replace(s, step=30)
    assert "progress    step 30 of 30" in status_text.render(s)
