"""A run, checkpoint or folder this user may not read or write: one line naming the path,
exit code 2 (no retry helps), never a traceback."""

from __future__ import annotations

from helpers import files_under, pyrecover, tiny_args


def test_a_run_this_user_may_not_read_is_one_line_and_exit_2_never_a_traceback(tmp_path,
                                                                              corpus):
    """A colleague's run, or one chmod'ed by accident: status, plot, ckpt and a resume each
    say which path and exit 2 (the job script does not requeue what no retry fixes); with
    --nproc 2 every rank ends at once, none waiting for a rank 0 that is gone, and none
    saying rank 0 died."""
    run = tmp_path / "theirs"
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "theirs", "train.max_steps=2"))
    assert done.returncode == 0, done.stderr
    resume = ["train", "--nproc", "2", *tiny_args(tmp_path, corpus, "theirs",
                                                   "train.max_steps=4", "train.device=cpu")]
    for locked in (run / "events.jsonl", run / "checkpoints"):
        mode = locked.stat().st_mode
        locked.chmod(0)
        try:
            readers = [["status", str(run)], resume] + (  # plot reads no checkpoint, and
                [["plot", str(run), "--out", str(tmp_path / "run.png")]]  # ckpt ls no event
                if locked.name == "events.jsonl" else [["ckpt", "ls", str(run)]])
            for args in readers:
                done = pyrecover(*args, file_permissions=True)
                assert done.returncode == 2, (args, done.stderr)
                assert f"error: permission denied: {locked}; give this user access to it" in \
                    done.stderr, (args, done.stderr)
                assert "Traceback" not in done.stderr and "TCPStore" not in done.stderr, \
                    done.stderr
                if args is resume and locked.name == "events.jsonl":  # rank 1 was in the loop
                    assert "rank 1: stopped because rank 0 stopped on an error" in done.stderr
                    assert "died" not in done.stderr, done.stderr  # (no resume helps)
                    assert "pyrecover: rank 1 " not in done.stderr  # not named as a cause
        finally:
            locked.chmod(mode)


def test_exporting_into_a_folder_this_user_may_not_write_is_a_permission_error_exit_2(
        tmp_path, corpus):
    """Into a read-only folder, export and convert said `storage: cannot write` and exit 1, a
    fault a retry may mend, where a missing folder under it was exit 2 `permission denied`."""
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "mine", "train.max_steps=1"))
    assert done.returncode == 0, done.stderr
    shut = tmp_path / "shut"
    shut.mkdir(0o555)
    for args in (["export", "--out", str(shut / "m.pt")],
                 ["export", "--out", str(shut / "m.safetensors")],
                 ["export", "--format", "hf", "--out", str(shut / "hf")],
                 ["convert", "--to", "torch", str(shut / "s.pt")]):
        done = pyrecover("ckpt", args[0], str(tmp_path / "mine"), *args[1:],
                         file_permissions=True)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr == (f"error: permission denied: {shut}; give this user access to "
                               "it (or run as its owner)\n"), (args, done.stderr)
    assert files_under(shut) == []


def test_a_checkpoints_folder_this_user_may_read_but_not_write_stops_the_start(tmp_path,
                                                                               corpus):
    """checkpoints/ readable but not writable (chmod 555, another user's copy): the resume
    read it, trained to the end with every save refused and failed at the final save. The
    health check's write now meets it first: one line naming the folder, exit 2."""
    run = tmp_path / "theirs"
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "theirs", "train.max_steps=2"))
    assert done.returncode == 0, done.stderr
    rows = (run / "metrics.jsonl").read_text()
    (run / "checkpoints").chmod(0o555)
    try:
        again = pyrecover("train", *tiny_args(tmp_path, corpus, "theirs", "train.max_steps=4"),
                          file_permissions=True)
    finally:
        (run / "checkpoints").chmod(0o755)
    assert again.returncode == 2, again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        f"error: permission denied: {run / 'checkpoints'}; give this user access to it (or "
        "run as its owner)"), again.stderr
    assert (run / "metrics.jsonl").read_text() == rows  # nothing trained


def test_one_step_folder_this_user_may_not_read_is_one_invalid_row_not_the_end_of_ls(
        tmp_path, corpus):
    """A chmod 000 step folder (a colleague's copy, a half-restored backup): `ckpt ls` and
    `verify` ended at its manifest with "permission denied", exit 2, hiding the checkpoints
    that are fine, while export and a resume skip it and use the next one."""
    run = tmp_path / "theirs"
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "theirs", "train.max_steps=2",
                                         "checkpoint.interval=1"))
    assert done.returncode == 0, done.stderr
    locked = run / "checkpoints" / "step-2"
    locked.chmod(0)
    try:
        listed = pyrecover("ckpt", "ls", str(run), file_permissions=True)
        fast = pyrecover("ckpt", "ls", str(run), "--fast", file_permissions=True)
        verified = pyrecover("ckpt", "verify", str(run), file_permissions=True)
    finally:
        locked.chmod(0o755)
    for done in (listed, fast):
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        rows = done.stdout.splitlines()[1:]
        assert rows[0].split()[0] == "2" and "INVALID: " in rows[0], done.stdout
        assert "Permission denied" in rows[0], done.stdout
        assert rows[1].split()[0] == "1" and "ok" in rows[1], done.stdout
    assert verified.returncode == 1 and "Traceback" not in verified.stderr, verified.stderr
    assert verified.stdout.splitlines()[1] == "step 1: ok", verified.stdout
    assert verified.stdout.startswith("step 2: INVALID: "), verified.stdout
