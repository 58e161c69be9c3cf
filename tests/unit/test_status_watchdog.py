"""`pyrecover status` shows hangs and stragglers, and counts a restart after a hang as one."""

from __future__ import annotations

from pyrecover import status, status_text
from pyrecover.rundir import RunDir


def test_status_names_the_hung_rank_the_straggler_and_the_restart_cause(tmp_path):
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0)
    run.event("straggler", rank=2, node="n2", seconds=0.4, median=0.1, windows=3, step=30)
    run.event("straggler", rank=2, node="n2", seconds=0.5, reference=0.1, windows=6, step=60)
    run.event("hang", rank=1, node="n1", phase="allreduce", step=64, seconds=61.0, limit=60.0,
              stacks="thread MainThread: ...")
    run.event("snapshot_persisted", rank=0, steps=[63])
    run.event("crash", rank=0, error="RuntimeError: Connection closed by peer")
    run.event("resume", step=63)
    s = status.read(run.root)
    assert s.restarts_by_cause == {"hang": 1}
    assert [h["phase"] for h in s.hangs] == ["allreduce"] and "stacks" not in s.hangs[0]
    assert [(g["rank"], g["step"]) for g in s.stragglers] == [(2, 60)]
    text = status_text.render(s)
    assert "restarts 1 x hang" in text
    assert "hang        rank 1 on n1: phase allreduce of step 64 ran 61.0s (limit 60.0s)" in text
    assert "straggler   rank 2 on n2: 0.5s own compute per step, the other ranks' 0.1s (step " \
        "60" in text
    # A record an earlier version wrote names the reference `median`.
    run.event("straggler", rank=3, node="n3", seconds=0.7, median=0.2, windows=3, step=61)
    assert "rank 3 on n3: 0.7s own compute per step, median 0.2s" in status_text.render(
        status.read(run.root))


def test_status_names_the_silent_ranks_and_the_suspect_node_of_a_hang(tmp_path):
    """The hang record names the peers that went silent and the node the job script then
    excludes; `status` showed only the rank that waited (itself healthy), so a person saw
    the wrong node unless they read --json."""
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0, time=100.0)
    for step in (8, 9):
        run.metric(step=step, loss=1.0, time=100.0 + step)
    run.event("hang", rank=0, node="n0", phase="allreduce", step=10, seconds=61.0, limit=60.0,
              silent_ranks=[2, 3], silent_nodes=["n1"], suspect_node="n1", time=171.0)
    run.event("resume", step=8, time=180.0)
    text = status_text.render(status.read(run.root))
    assert ("hang        rank 0 on n0: phase allreduce of step 10 ran 61.0s (limit 60.0s); "
            "silent ranks [2, 3] on n1, suspect node n1") in text
    assert "lost        1 step redone after interruptions" in text  # (one step, not 1 steps)


def test_a_run_the_watchdog_ended_is_shown_hung_not_killed(tmp_path):
    """A hang that ended the attempt (exit 76) with nothing after it; a later start is the
    run's state again."""
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0)
    run.event("checkpoint", step=10)
    run.event("hang", rank=0, node="n0", phase="forward", step=12, seconds=31.0, limit=30.0)
    s = status.read(run.root)
    assert s.state == "hung"
    assert "state       hung" in status_text.render(s)
    run.event("resume", step=10)
    assert status.read(run.root).state != "hung"


def test_status_says_how_many_decisions_and_hangs_it_leaves_out_and_tells_in_job_restarts_apart(
        tmp_path):
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0)
    for n in range(5):
        run.event("hang", rank=1, node="n1", phase="forward", step=10 + n, seconds=6.0,
                  limit=5.0)
    for n in range(3):
        run.event("requeue", job_id="7", restart_count=n, exit_code=76, reason="hang")
    for n in (1, 2):  # the same restart count: only the in-job count tells them apart
        run.event("restart_in_job", job_id="7", restart_count=3, in_job_restart=n,
                  exit_code=76, reason="hang")
    text = status_text.render(status.read(run.root))
    assert "requeue     2 earlier decisions in --json" in text
    assert "hang        2 earlier hangs in --json" in text
    assert text.count("hang        rank 1 on n1") == 3 and "of step 14" in text
    assert "job 7 restart 2: exit 76 -> requeue (hang)" in text
    assert "restart 1:" not in text  # among the two left out
    assert "restart 3 (in the job 1): exit 76 -> restart_in_job" in text
    assert "restart 3 (in the job 2): exit 76 -> restart_in_job" in text
    assert len(status.read(run.root).requeue_decisions) == 5  # --json has every one
