"""`pyrecover status` reads a run whose events.jsonl or metrics.jsonl holds lines it did not
write (hand-edited, another tool's, a value of the wrong type): it leaves those records out,
says how many, and never stops with a traceback."""

from __future__ import annotations

import json
import random

import pytest

from pyrecover import status, status_text
from pyrecover.rundir import RunDir

# Values of every JSON type, including the ones a float() or int() of a field chokes on.
HOSTILE = ["", "abc", "12", None, True, [], [1], {}, {"a": 1}, 10**400, -1, 0, 1e308, 3.5]


def _a_real_history(run: RunDir) -> None:
    run.event("start", step=0)
    run.event("phase", phase="process_start")
    run.event("checkpoint", step=10, blocked=0.2, seconds=0.4)
    run.event("stop", step=12, reason="signal")
    run.event("phase", phase="stop_agreed")
    run.event("requeue", exit_code=75, reason="stopped cleanly", job_id="7", restart_count=0)
    run.event("phase", phase="process_start")
    run.event("resume", step=10, steps_lost=2, restore_seconds=0.3)
    run.event("hang", rank=1, node="n1", phase="allreduce", step=14, seconds=61.0, limit=60.0)
    run.event("straggler", rank=2, node="n2", seconds=0.4, median=0.1, windows=3, step=14)
    run.event("profile", first=12, last=14, steps=3, wall_s=0.5, kernels_s=0.4, idle_s=0.1,
              to_host_s=0.02, to_device_s=0.001, trace="profile/steps-12-14-rank-0.trace.json.gz")
    for step in range(1, 16):
        run.metric(step=step, loss=2.0, step_time=0.1, checkpoint_stall_total=0.2)


def test_a_record_with_a_value_of_the_wrong_type_is_left_out_and_counted(tmp_path):
    run = RunDir(tmp_path / "exp")
    run.create()
    _a_real_history(run)
    clean = status.read(run.root)
    with run.events.open("a") as f:
        f.write(json.dumps({"event": "resume", "time": "yesterday", "step": 3}) + "\n")
        f.write(json.dumps({"event": "checkpoint", "time": 1.0, "blocked": [1]}) + "\n")
    s = status.read(run.root)
    assert s.skipped_records == 2
    assert (s.starts, s.checkpoint_write_seconds, s.checkpoint_stall_seconds) == (
        clean.starts, clean.checkpoint_write_seconds, clean.checkpoint_stall_seconds)
    assert "skipped     2 records" in status_text.render(s)


def test_lines_that_are_no_record_at_all_are_counted_and_never_stop_status_or_a_resume(
        tmp_path):
    """Garbage, a torn line, a JSON value that is no object, and one nested too deeply for
    Python's parser (a RecursionError, which a resuming trainer's read of events.jsonl hit on
    every requeue): each is left out and counted; a last line without its newline is a
    record still being written, left out but not counted."""
    from pyrecover.checkpoint import interval

    run = RunDir(tmp_path / "exp")
    run.create()
    _a_real_history(run)
    clean = status.read(run.root)
    deep = "[" * 200_000 + "]" * 200_000
    with run.events.open("a") as f:
        f.write(f'garbage\n{{"event": "stop", "ti\n[1, 2]\n{deep}\n')
    with run.metrics.open("a") as f:
        f.write(f'{deep}\n{{"step": 16, "loss"')  # the last line: still being written
    s = status.read(run.root)
    assert s.skipped_records == 5
    assert (s.starts, s.checkpoint_write_seconds, s.checkpoint_stall_seconds) == (
        clean.starts, clean.checkpoint_write_seconds, clean.checkpoint_stall_seconds)
    assert "skipped     5 records" in status_text.render(s)
    interval.for_config("auto", 1.0, 100, list(run.read_events()))  # what a resume reads


def test_status_never_fails_on_any_field_of_any_record_set_to_any_json_value(tmp_path):
    """Property: replace one field of one record with a hostile value, 300 times over every
    record and field; status reads and renders each time, leaving out at most that record."""
    rng = random.Random(20261124)
    base = RunDir(tmp_path / "base")
    base.create()
    _a_real_history(base)
    files = {"events.jsonl": base.events.read_text().splitlines(),
             "metrics.jsonl": base.metrics.read_text().splitlines()}
    for trial in range(300):
        run = RunDir(tmp_path / f"t{trial}")
        run.create()
        name = rng.choice(sorted(files))
        lines = list(files[name])
        i = rng.randrange(len(lines))
        record = json.loads(lines[i])
        key = rng.choice(sorted(record) + ["event", "time", "step"])
        record[key] = rng.choice(HOSTILE)
        lines[i] = json.dumps(record)
        (run.root / name).write_text("\n".join(lines) + "\n")
        other = "metrics.jsonl" if name == "events.jsonl" else "events.jsonl"
        (run.root / other).write_text("\n".join(files[other]) + "\n")
        s = status.read(run.root)
        assert s.skipped_records <= 1, (name, record)
        status_text.render(s)


def test_a_damaged_run_yaml_leaves_out_max_steps_and_status_still_reads(tmp_path):
    run = RunDir(tmp_path / "exp")
    run.create()
    _a_real_history(run)
    for text in ("train:\n  max_steps: [\n", "a: &x 1\nb: *x\n", "\xff not utf-8", "- a list\n"):
        run.config.write_bytes(text.encode("latin-1"))
        assert status.read(run.root).max_steps is None
    run.config.write_text("train:\n  max_steps: 40\n")
    assert status.read(run.root).max_steps == 40


def _write(run: RunDir, events: list[dict], metrics: list[dict]) -> None:
    run.events.write_text("".join(json.dumps(e) + "\n" for e in events))
    run.metrics.write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_every_start_after_the_first_is_a_restart_with_its_cause_and_its_lost_steps(tmp_path):
    """A kill before the first checkpoint (the next start is from step 0), a start killed
    before it trained, an error, and a finished run continued with more steps are restarts
    too; status counts one start per process start, one wall time for goodput and the
    ledger, and an error only until the run starts again."""
    from test_ledger import FROM_SCRATCH, SCRATCH_METRICS

    run = RunDir(tmp_path / "exp")
    run.create()
    _write(run, FROM_SCRATCH, SCRATCH_METRICS)
    s = status.read(run.root, now=100.0)
    assert s.starts == 3 and s.steps_lost == 8
    assert s.restarts_by_cause == {"killed (no record)": 1, "ended during start-up": 1}
    assert s.wall_seconds == s.ledger["wall_seconds"] == 38.0
    assert s.goodput == s.ledger["effective_share"]
    assert "restarts 1 x ended during start-up, 1 x killed (no record)" in status_text.render(s)

    # A start refused for a config or data error records its start-up phases, then the
    # error: an attempt of its own, not the end of the finished one before it.
    error = [ph("process_start", 39.0), ph("imports_done", 39.5),
             {"event": "error", "time": 40.0, "rank": 0, "error": "DataError: no corpus"}]
    more = [*error, ph("process_start", 50.0), {"event": "resume", "time": 52.0, "step": 5,
                                                 "steps_lost": 0}, ph("first_step", 53.0)]
    _write(run, [*FROM_SCRATCH, *error], SCRATCH_METRICS)
    s = status.read(run.root, now=100.0)
    assert s.last_error == "DataError: no corpus" and s.starts == 4
    assert s.restarts_by_cause["continued after finishing"] == 1
    _write(run, [*FROM_SCRATCH, *more], SCRATCH_METRICS)
    s = status.read(run.root, now=100.0)
    assert s.last_error is None  # it started again
    assert s.restarts_by_cause == {"killed (no record)": 1, "ended during start-up": 1,
                                   "continued after finishing": 1, "error": 1}
    _write(run, FROM_SCRATCH + more[len(error):], SCRATCH_METRICS)
    assert status.read(run.root, now=100.0).restarts_by_cause[
        "continued after finishing"] == 1  # max_steps raised after it finished


def ph(name: str, at: float) -> dict:
    return {"event": "phase", "phase": name, "time": at}


def test_the_ledger_takes_the_queue_times_of_the_jobs_that_ran_the_run_not_the_one_queued(
        tmp_path):
    """Job 41 ran the run after 900 s in the queue; then the run was launched again as job
    57, still pending. The ledger asked sacct about job 57 (no start yet), and the 900 s
    moved out of the queue wait. An array task is asked about by its own name."""
    from test_ledger import EVENTS, METRICS

    run = RunDir(tmp_path / "exp")
    run.create()
    _write(run, [{**e, "job_id": "41", "array_task": "40_1"} for e in EVENTS], METRICS)
    asked: list[str] = []
    times = {"40_1": [(100.0 - 900.0, 99.0, 127.0), (140.0, 148.0, 174.0)],
             "57": [(180.0, None, None)]}

    def sacct(name: str) -> list:
        asked.append(name)
        return [t for t in times.get(name, []) if t[1] is not None]

    s = status.read(run.root, now=200.0, squeue=lambda name: None, sacct=sacct,
                    queued=lambda script: [("57", "PENDING")])
    assert s.job_id == "57" and s.slurm_state == "PENDING"  # what is queued now
    said = status.read(run.root, now=200.0, squeue=lambda name: None,
                       queued=lambda script: [("57", "PENDING")],
                       reason={"57": "QOSMaxJobsPerUserLimit"}.get)
    assert "; SLURM job 57: PENDING (QOSMaxJobsPerUserLimit)\n" in status_text.render(said)
    assert asked == ["40_1"]
    assert s.ledger["causes"]["queue_wait"] == 899.0 + 8.0
    assert s.ledger["queue_from_slurm"]
    assert sum(s.ledger["causes"].values()) == pytest.approx(s.ledger["wall_seconds"], abs=1e-3)


@pytest.mark.parametrize("recorded, shown", [
    ("run:\n  exp_name: gpt-125m-lr3e-4\ntrain:\n  max_steps: 40\n", ("gpt-125m-lr3e-4", 40)),
    ("run: [not, a, mapping]\ntrain:\n  max_steps: 40\n", ("moved-here", 40)),
    ("train: {max_steps: many}\n", ("moved-here", None)),
    ("{{{ not yaml", ("moved-here", None)),
])
def test_status_names_the_run_by_its_recorded_exp_name_and_survives_a_damaged_run_yaml(
        tmp_path, recorded, shown):
    """A run folder moved or renamed by hand is still named as its config names it."""
    run = RunDir(tmp_path / "moved-here")
    run.create()
    _a_real_history(run)
    run.config.write_text(recorded)
    s = status.read(run.root)
    assert (s.exp_name, s.max_steps) == shown
    assert status_text.render(s).splitlines()[0] == f"run         {run.root} ({shown[0]})"


def test_idle_time_between_launches_is_its_own_row_and_left_out_of_each_share(tmp_path):
    """A run finished, then extended 10,000 s later: the ledger's shares are of the launched
    time, so productive and the effective share agree; idle has a row and no share."""
    from pyrecover.rundir import append_jsonl

    run = RunDir(tmp_path / "run")
    run.create()
    for t0, began, kind in ((1000.0, 0, "start"), (11000.0, 20, "resume")):
        append_jsonl(run.events, {"event": "phase", "phase": "process_start", "time": t0})
        append_jsonl(run.events, {"event": kind, "step": began, "time": t0 + 1.0})
        append_jsonl(run.events, {"event": "phase", "phase": "first_step", "time": t0 + 2.0})
        for s in range(1, 21):
            append_jsonl(run.metrics, {"step": began + s, "time": t0 + 2.0 + s,
                                       "step_time": 1.0})
        append_jsonl(run.events, {"event": "finish", "step": began + 20, "time": t0 + 23.0})
    s = status.read(run.root)
    text = status_text.render(s).splitlines()
    wall = next(line for line in text if line.startswith("wall time"))
    assert wall.startswith(f"wall time   {s.ledger['wall_seconds']:.1f}s across all attempts, "
                           "9977.0s of it idle between launches; of the 46.0s launched, ")
    assert f"{s.goodput:.1%} effective training" in wall and s.goodput > 0.8
    rows = {line.split()[0]: line.split()[-1] for line in text if line.startswith("  ")}
    assert rows["idle"] == "-" and rows["productive"] == f"{s.goodput:.1%}"
    # the same seconds as the wall time line's (it said `of 46s wall time`, beside 9977.0s idle)
    goodput = next(line for line in text if line.startswith("goodput"))
    assert goodput.startswith(f"goodput     {s.goodput:.1%} of the 46.0s launched in "), goodput


def test_a_checkpoint_stamped_after_now_is_0s_old_in_status_and_ckpt_ls_never_negative(
        tmp_path):
    """A manifest's time comes from the node that saved it (a clock a little ahead of this
    one), or from a save committed while status reads: `-0s old` and `-5s` said otherwise."""
    from pyrecover.checkpoint import listing, store

    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0)
    pending = store.begin(run.checkpoints, 10)
    with pending.open("state.pt") as f:
        f.write(b"x" * 100)
    folder = pending.commit("vanilla", 1, {"step": 10})
    saved = store.read_manifest(folder)["time"]
    s = status.read(run.root, now=saved - 5.0)
    assert s.last_checkpoint["age_s"] == 0
    assert ", 0s old;" in status_text.render(s)
    (row,) = listing.list_checkpoints(run, checksums=False, now=saved - 5.0)
    assert row.age_s == 0 and listing.human_age(row.age_s) == "0s"


def test_a_restart_after_a_failed_health_check_is_counted_as_one(tmp_path):
    """The job script requeues exit 77 as `health check failed`; status's restarts by
    cause say the same, not 'ended during start-up'."""
    def failed(at: float) -> list[dict]:  # rank 1's record comes before rank 0's phases
        return [{"event": "health", "time": at + 2.0, "ok": False, "rank": 1,
                 "node": "node2", "check": "gpu", "error": "fault injected"},
                ph("process_start", at + 1.0), ph("imports_done", at + 1.5),
                {"event": "requeue", "time": at + 3.0, "exit_code": 77, "job_id": "7",
                 "reason": "health check failed"}]
    started = [ph("process_start", 30.0), {"event": "start", "time": 31.0, "step": 0},
               ph("first_step", 32.0)]
    run = RunDir(tmp_path / "exp")
    run.create()
    _write(run, failed(0.0) + failed(10.0) + started, [])
    s = status.read(run.root, now=100.0)
    assert s.restarts_by_cause == {"health check failed": 2}
    assert "starts      3: restarts 2 x health check failed" in status_text.render(s)


def test_a_sweep_trial_waiting_in_its_array_is_named_with_its_task_s_state(tmp_path):
    """A trial held back by the array's max_parallel read 'not started' with no word of
    SLURM, though `pyrecover cancel` found its pending task: the trial's task is the job
    queued for it (a trial has no job.sbatch of its own for squeue to match)."""
    run = RunDir(tmp_path / "trial-3")
    run.create()
    states = {"9_3": "PENDING"}
    s = status.read(run.root, now=100.0, squeue=states.get, queued=lambda script: [],
                    reason={"9_3": "JobArrayTaskLimit"}.get, task="9_3")
    assert (s.job_id, s.slurm_state) == ("9_3", "PENDING")
    assert "state       not started; SLURM job 9_3: PENDING (JobArrayTaskLimit)\n" in \
        status_text.render(s)
    # Ran as task 40_1, which ended; the sweep launched again: its new task is the one shown.
    _write(run, [{**ph("process_start", 1.0), "job_id": "41", "array_task": "40_1"},
                 {"event": "start", "time": 2.0, "step": 0, "job_id": "41",
                  "array_task": "40_1"},
                 {"event": "no_requeue", "time": 3.0, "job_id": "41", "reason": "cancelled"}],
           [])
    states = {"40_1": "CANCELLED", "57_1": "PENDING"}
    s = status.read(run.root, now=100.0, squeue=states.get, queued=lambda script: [],
                    task="57_1")
    assert (s.job_id, s.slurm_state) == ("57_1", "PENDING")
    s = status.read(run.root, now=100.0, squeue=states.get, queued=lambda script: [],
                    task="40_1")  # not launched again: the task that ran it, as it ended
    assert (s.job_id, s.slurm_state) == ("40_1", "CANCELLED")


def test_a_hung_run_s_progress_is_the_last_step_it_finished_not_the_one_it_hung_in(tmp_path):
    """Hung in step 8 after finishing step 7: status said 'progress step 8', one step more
    than the run computed (the hang event names the step it was stuck in)."""
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0, time=1.0)
    for step in range(1, 8):
        run.metric(step=step, loss=2.0, step_time=0.1, time=1.0 + step)
    run.event("hang", rank=1, node="n1", phase="forward", step=8, seconds=5.0, limit=5.0,
              time=14.0)
    s = status.read(run.root, now=100.0)
    assert s.state == "hung" and s.step == 7
    assert "progress    step 7\n" in status_text.render(s)


def test_the_productive_row_shows_the_same_share_as_effective_training():
    """0.509 s of 3.961 s read '12.8% effective training' above and 'productive 12.9%' in
    the row below it: the share was rounded twice one way and once the other."""
    from pyrecover.status_text import _ledger_lines

    book = {"wall_seconds": 3.961, "launched_seconds": 3.961, "effective_share": 0.1285,
            "queue_from_slurm": False,
            "causes": {"queue_wait": 0.0, "start_up": 3.336, "restore": 0.0,
                       "checkpoint_stall": 0.044, "lost_work": 0.0, "productive": 0.509,
                       "idle": 0.0, "remainder": 0.072}}
    lines = _ledger_lines(book, None)
    said = f"{book['effective_share']:.1%}"
    assert f" {said} effective training" in lines[0]
    assert next(x for x in lines if "productive" in x).endswith(said)


def test_snapshots_the_survivors_persisted_past_the_checkpoint_are_shown(tmp_path):
    """Memory mode, a rank SIGKILLed at step 12: the survivors wrote their snapshots of steps
    12 and 11, which the next start commits, while status said only 'checkpoint step 10',
    as if steps 11 and 12 were to be redone."""
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0, time=1.0)
    run.event("snapshot_persisted", rank=0, steps=[12, 11], time=5.0)
    for step in (11, 12):
        (run.checkpoints / f".snap-step-{step}").mkdir(parents=True)
    (run.checkpoints / ".snap-step-x").mkdir()  # not one of pyrecover's: left out
    s = status.read(run.root, now=100.0)
    assert s.persisted_snapshots == [12, 11]
    assert "snapshots   steps 12, 11 persisted by the survivors of a crash; the next start " \
        "commits the newest whole one" in status_text.render(s)


def test_saves_that_failed_since_the_last_checkpoint_are_shown(tmp_path):
    """A periodic save that fails (a full disk, a quota) is logged and training goes on:
    hours later status still read 'checkpoint step 10' and nothing else, though every save
    since had failed and a crash would lose all of it."""
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0, time=1.0)
    run.event("checkpoint_failed", step=5, reason="OSError: old, before the commit", time=1.5)
    run.event("checkpoint", step=10, blocked=0.1, time=2.0)
    for step in (20, 30, 40):
        run.event("checkpoint_failed", step=step, reason="OSError: [Errno 122] Disk quota "
                  "exceeded", time=step / 10.0)
    s = status.read(run.root, now=100.0)
    assert [f["step"] for f in s.failed_checkpoints] == [20, 30, 40]
    assert "failed      3 saves since the last checkpoint, the newest step 40: OSError: " \
        "[Errno 122] Disk quota exceeded" in status_text.render(s)
    run.event("checkpoint", step=50, blocked=0.1, time=5.0)  # a save went through again
    assert status.read(run.root, now=100.0).failed_checkpoints == []


def test_a_job_cancelled_while_it_started_up_is_cancelled_not_killed(tmp_path):
    """`pyrecover cancel` of a job still importing or restoring: its trainer records its
    resume after the cancel, and SLURM's KillWait ends it before its stop. Status said
    `killed (no end recorded)` of a run its user had cancelled."""
    run = RunDir(tmp_path / "exp")
    run.create()
    job = {"job_id": "7", "restart_count": 1}
    earlier = [{"event": "start", "time": 1.0, "step": 0, **job, "restart_count": 0},
               {"event": "stop", "time": 5.0, "step": 4, "reason": "signal", **job,
                "restart_count": 0},
               {"event": "requeue", "time": 6.0, "exit_code": 75, "reason": "stopped cleanly",
                **job, "restart_count": 0},
               ph("process_start", 20.0)]
    cancelled = [*earlier, {"event": "cancel", "time": 21.0, "job_id": "7",
                            "slurm_state": "RUNNING"},
                 {"event": "resume", "time": 25.0, "step": 4, "steps_lost": 0, **job}]
    _write(run, cancelled, [])
    assert status.read(run.root, now=30.0).state == "cancelled"
    # A cancel of another job, or one before the job requeued, is not this attempt's.
    for other in ({"job_id": "6"}, {}):
        shifted = [*earlier[:2], {"event": "cancel", "time": 5.5, "job_id": "7"}, *earlier[2:],
                   {"event": "resume", "time": 25.0, "step": 4, "steps_lost": 0, **job,
                    **other}]
        _write(run, shifted, [])
        assert status.read(run.root, now=30.0).state != "cancelled"


@pytest.mark.parametrize("ending, before", [
    ({"event": "finish", "step": 2}, "finished"),
    ({"event": "cancel", "job_id": "41"}, "cancelled"),
])
def test_a_run_that_had_ended_and_is_launched_again_says_so_not_how_it_ended(
        tmp_path, ending, before):
    """A finished run launched again with a higher train.max_steps read `finished; SLURM job
    57: PENDING` while it waited: the new job trains on, the run has not ended."""
    run = RunDir(tmp_path / "exp")
    run.create()
    started = {"event": "start", "time": 1.0, "step": 0, "job_id": "41"}
    _write(run, [started, {**ending, "time": 2.0}], [])
    alone = status.read(run.root, now=5.0, squeue=lambda name: None,
                        queued=lambda script: [])
    assert alone.state.startswith(before)
    again = status.read(run.root, now=5.0, squeue=lambda name: None,
                        queued=lambda script: [("57", "PENDING")])
    assert (again.state, again.job_id, again.slurm_state) == (
        f"launched again (before: {alone.state})", "57", "PENDING")
    stopped = RunDir(tmp_path / "stopped")
    stopped.create()
    _write(stopped, [started, {"event": "stop", "time": 2.0, "step": 1, "reason": "SIGUSR2"}],
           [])
    waits = status.read(stopped.root, now=5.0, squeue=lambda name: None,
                        queued=lambda script: [("57", "PENDING")])
    assert waits.state.startswith("stopped")  # its new job resumes it: that word stays
