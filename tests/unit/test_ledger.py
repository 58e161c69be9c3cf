"""The goodput ledger: a run's wall time by cause, adding up to the wall time."""

from __future__ import annotations

import time

import pytest

from pyrecover.ledger import CAUSES, JobTimes, ledger
from pyrecover.slurm.query import parse_sacct_times


def ph(name: str, at: float) -> dict:
    return {"event": "phase", "phase": name, "time": at}


# Attempt 1 (t=100..): starts in 10 s, trains steps 1-14 at 1 s each, checkpoints at step 10
# (0.5 s blocked), is killed after step 14. Attempt 2 (t=150..) resumes from step 10 (4 steps
# redone), is stopped by a signal and saves; attempt 3 would follow.
EVENTS = [
    ph("process_start", 100.0), ph("imports_done", 104.0), ph("group_up", 106.0),
    ph("checkpoint_chosen", 110.0), {"event": "start", "time": 110.0, "step": 0},
    ph("first_step", 112.0),
    {"event": "checkpoint", "time": 121.5, "step": 10, "blocked": 0.5},
    ph("process_start", 150.0), ph("checkpoint_chosen", 158.0), ph("restored", 160.0),
    {"event": "resume", "time": 160.0, "step": 10, "steps_lost": 4}, ph("first_step", 161.0),
    ph("signal_seen", 170.0), ph("stop_agreed", 171.0), ph("save_done", 172.5),
    {"event": "stop", "time": 172.5, "step": 20}, ph("exit", 173.0),
]
METRICS = ([{"time": 112.0 + s, "step": s, "step_time": 1.0, "checkpoint_stall_total": 0.0}
            for s in range(1, 10)] +
           [{"time": 122.0 + s, "step": 10 + s, "step_time": 1.0,
             "checkpoint_stall_total": 0.5} for s in range(0, 5)])


def test_each_cause_is_counted_once_and_all_add_up_to_the_wall_time():
    book = ledger(*in_job((EVENTS, METRICS)))  # a job: SLURM started it again after the kill
    c = book.causes
    assert book.wall_seconds == 73.0  # 100 .. 173
    assert c["start_up"] == 10.0 + 2.0 + 8.0 + 1.0
    assert c["restore"] == 2.0
    assert c["checkpoint_stall"] == 0.5 + 1.5  # the loop blocked, and the stop checkpoint
    assert c["lost_work"] == 4.0  # 4 steps redone at 1 s each
    assert c["productive"] == (126.0 - 112.0) - 0.5 - 4.0 + (171.0 - 161.0)
    assert c["queue_wait"] == 0.0
    assert sum(c.values()) == pytest.approx(book.wall_seconds, abs=1e-6)
    assert c["remainder"] == (150.0 - 126.0) + (173.0 - 172.5)  # killed to restarted; exit
    assert book.effective_share == round(c["productive"] / 73.0, 4)


def test_the_trainer_s_own_count_at_its_finish_or_stop_is_the_attempt_s_stall():
    """A metrics row is written before its step's save, and a save's own `blocked` once left
    out its commit: the newest row plus the later saves' `blocked` missed the last commit (a tiny
    vanilla run: 0.237 s of the 0.245 s its trainer counted). The trainer's count at its
    finish, or where its ranks agreed to stop, holds every second."""
    stopped = [*EVENTS[:13], {**EVENTS[13], "checkpoint_stall_total": 0.3}, *EVENTS[14:]]
    assert stopped[13]["phase"] == "stop_agreed"
    book = ledger(stopped, METRICS)
    assert book.causes["checkpoint_stall"] == 0.5 + 0.3 + 1.5  # the stop checkpoint's span too
    assert sum(book.causes.values()) == pytest.approx(book.wall_seconds, abs=1e-6)
    # Finished after step 14 with a save: the row of step 14 (126.0, before that save)
    # counted 0.5 s, the finish, after the save's commit, 0.8 s.
    done = [*EVENTS[:7], {"event": "finish", "time": 127.0, "step": 14,
                          "checkpoint_stall_total": 0.8}]
    book = ledger(done, METRICS)
    assert book.causes["checkpoint_stall"] == 0.8
    assert book.causes["productive"] == (127.0 - 112.0) - 0.8
    assert sum(book.causes.values()) == pytest.approx(book.wall_seconds, abs=1e-6)


def test_slurm_queue_times_count_as_queue_wait_and_extend_the_wall_time():
    jobs = [JobTimes(submit=90.0, start=99.0, end=127.0), JobTimes(140.0, 148.0, 174.0)]
    book = ledger(EVENTS, METRICS, jobs)
    assert book.wall_seconds == 84.0  # submitted at 90, the job ended at 174
    assert book.causes["queue_wait"] == 9.0 + 8.0
    assert sum(book.causes.values()) == pytest.approx(84.0, abs=1e-6)
    assert book.queue_from_slurm


def test_a_run_without_records_has_an_empty_ledger():
    book = ledger([], [])
    assert book.wall_seconds == 0.0 and set(book.causes) == set(CAUSES)
    assert book.effective_share is None


def test_sacct_lines_become_one_time_triple_per_attempt():
    text = ("2026-11-23T08:00:00|2026-11-23T08:00:05|2026-11-23T08:01:00\n"
            "2026-11-23T08:01:12|2026-11-23T08:01:20|Unknown\n"
            "2026-11-23T08:02:00|Unknown|Unknown\n")
    rows = parse_sacct_times(text)
    base = time.mktime(time.strptime("2026-11-23T08:00:00", "%Y-%m-%dT%H:%M:%S"))
    assert [(s - base, t - base, e if e is None else e - base) for s, t, e in rows] == [
        (0.0, 5.0, 60.0), (72.0, 80.0, None)]


def test_records_from_before_phase_timings_still_add_up_attempt_by_attempt():
    old = [{"event": "start", "time": 0.0}, {"event": "stop", "time": 10.0},
           {"event": "requeue", "time": 11.0}, {"event": "resume", "time": 30.0,
                                                 "steps_lost": 0},
           {"event": "finish", "time": 40.0}]
    metrics = [{"time": float(t), "step": t, "step_time": 1.0} for t in (5, 10, 35, 40)]
    book = ledger(old, metrics)
    assert book.wall_seconds == 40.0
    assert book.causes["productive"] == 10.0 + 10.0  # each attempt from its start record
    assert book.causes["remainder"] == 20.0  # stopping, requeue and the restart in between
    assert sum(book.causes.values()) == pytest.approx(40.0, abs=1e-6)


# Attempt 1 trains steps 1-8 and is killed before its first checkpoint; attempt 2 is killed
# while it starts (no start record); attempt 3 starts over from step 0 and trains 1-5.
FROM_SCRATCH = [
    ph("process_start", 0.0), {"event": "start", "time": 2.0, "step": 0}, ph("first_step", 3.0),
    ph("process_start", 20.0), ph("imports_done", 22.0),
    ph("process_start", 30.0), {"event": "start", "time": 32.0, "step": 0},
    ph("first_step", 33.0), {"event": "finish", "time": 38.0, "step": 5},
]
SCRATCH_METRICS = ([{"time": 3.0 + s, "step": s, "step_time": 1.0} for s in range(1, 9)]
                   + [{"time": 33.0 + s, "step": s, "step_time": 1.0} for s in range(1, 6)])


def test_a_start_over_after_a_kill_loses_all_the_training_before_it():
    """No checkpoint survived attempt 1, so its 8 steps are lost work and counted as redone,
    though the restart is a `start` (from step 0), not a `resume`; the start killed in
    between trained nothing and moves nothing."""
    from pyrecover.ledger import steps_lost

    book = ledger(FROM_SCRATCH, SCRATCH_METRICS)
    assert book.causes["lost_work"] == 8.0 and book.causes["productive"] == 5.0
    assert sum(book.causes.values()) == pytest.approx(book.wall_seconds, abs=1e-6)
    assert steps_lost(FROM_SCRATCH, SCRATCH_METRICS) == 8
    assert steps_lost(EVENTS, METRICS) == 4  # a resume's own count


def attempt(start: float, began: int, until: int, end: str = "", ckpts=(), stopped=False):
    """An attempt's records: its process start at `start`, training from step `began` (a
    resume, or a start at 0) at 1 s a step to step `until`, checkpoints at `ckpts`, then a
    `stop` (saved) if `stopped`, else nothing (killed)."""
    first = start + 2.0
    kind = {"event": "start", "step": 0} if began == 0 else {"event": "resume", "step": began}
    events = [ph("process_start", start), ph("checkpoint_chosen", start + 1.0),
              {**kind, "time": start + 1.0}, ph("first_step", first)]
    events += [{"event": "checkpoint", "time": first + c - began, "step": c, "blocked": 0.0}
               for c in ckpts]
    if stopped:
        events += [ph("stop_agreed", first + until - began), {"event": "stop", "step": until,
                                                              "time": first + until - began}]
    metrics = [{"time": first + s - began, "step": s, "step_time": 1.0}
               for s in range(began + 1, until + 1)]
    return events, metrics


def run_of(*parts):
    return [e for p in parts for e in p[0]], [m for p in parts for m in p[1]]


@pytest.mark.parametrize("name, parts, lost", [
    # A stops cleanly at 100; B resumes there and is killed at 120; its checkpoint at 100 is
    # found damaged, so C resumes from 50: A's steps 51-100 and B's 101-120 are redone.
    ("an older checkpoint", (attempt(0, 0, 100, ckpts=(50, 100), stopped=True),
                             attempt(200, 100, 120), attempt(400, 50, 60, stopped=True)), 70),
    # A reaches 120 (checkpoint 100) and is killed; B resumes at 100, saves 110, is killed at
    # 115; C resumes at 110: A's 101-120 and B's 111-115, not 120 - 110 again.
    ("two kills", (attempt(0, 0, 120, ckpts=(100,)), attempt(200, 100, 115, ckpts=(110,)),
                   attempt(400, 110, 130, stopped=True)), 25),
])
def test_lost_work_is_every_attempt_s_steps_that_a_later_one_computed_again(name, parts, lost):
    from pyrecover.ledger import steps_lost, steps_redone

    events, metrics = run_of(*parts)
    assert steps_lost(events, metrics) == lost, name
    book = ledger(events, metrics)
    assert book.causes["lost_work"] == pytest.approx(lost * 1.0)
    assert sum(book.causes.values()) == pytest.approx(book.wall_seconds, abs=1e-6)
    # What each resume records as redone adds up to the same count.
    resumes = [p for p in parts[1:]]
    redone = sum(steps_redone(*run_of(*parts[:i + 1]), step=p[0][2]["step"])
                 for i, p in enumerate(resumes))
    assert redone == lost


def test_sacct_rows_that_overlap_count_once_and_the_remainder_never_goes_negative():
    # sacct asked about a whole array lists every task: three rows queued together.
    events, metrics = run_of(attempt(100, 0, 20, stopped=True))
    jobs = [JobTimes(0.0, 100.0, 130.0), JobTimes(0.0, 60.0, 90.0), JobTimes(0.0, 30.0, 200.0)]
    book = ledger(events, metrics, jobs)
    assert book.causes["queue_wait"] == 100.0
    assert book.wall_seconds == 130.0  # from the row that started the attempt
    assert book.causes["remainder"] >= 0
    assert sum(book.causes.values()) == pytest.approx(book.wall_seconds, abs=1e-6)


def test_an_attempt_that_outlived_the_next_one_s_start_is_not_counted_twice():
    # A new process started (the lock's wait allows it) while the old one still wrote records.
    events, metrics = run_of(attempt(0, 0, 30, stopped=True), attempt(25, 30, 40, stopped=True))
    book = ledger(events, metrics)
    assert book.causes["remainder"] >= 0
    assert sum(book.causes.values()) == pytest.approx(book.wall_seconds, abs=1e-6)


def test_the_time_a_rank_hung_is_not_productive_and_still_adds_up():
    # Attempt 1 hangs in step 15's allreduce at t=127 (a peer stopped); its watchdog fires
    # 500 s later; a step row written after the stopped peer went on holds those 500 s.
    hung = [*EVENTS[:7], {"event": "hang", "time": 627.0, "rank": 1, "seconds": 500.0,
                          "phase": "allreduce", "step": 15}]
    rows = [*METRICS[:14], {"time": 627.5, "step": 15, "step_time": 500.5,
                            "checkpoint_stall_total": 0.5}]
    book = ledger(hung, rows)
    c = book.causes
    assert c["productive"] == (127.0 - 112.0) - 0.5  # the steps before the hung phase
    assert sum(c.values()) == pytest.approx(book.wall_seconds, abs=1e-6)
    assert c["remainder"] >= 500.0


def finished(events: list[dict], job_id: str | None = None) -> list[dict]:
    """finished: an attempt's events as a run that ended with its last step, or (job_id) as
    a job's stop that its script then requeued."""
    last = events[-1]
    if job_id is None:
        return [*events, {"event": "finish", "time": last["time"] + 1.0}]
    return [*events[:-1], {**last, "job_id": job_id},
            {"event": "requeue", "time": last["time"] + 1.0, "job_id": job_id}]


def test_the_time_between_a_finish_and_a_later_launch_is_idle_and_no_share_of_it_is_lost():
    """A finished run extended days later (more steps) fell from 79% to 9% effective training
    in a sweep: the days counted as its remainder."""
    a = attempt(0, 0, 20, stopped=True)
    b = attempt(10_000, 20, 40, stopped=True)
    events, metrics = run_of((finished(a[0]), a[1]), b)
    book = ledger(events, metrics)
    c = book.causes
    end_a = max(e["time"] for e in finished(a[0]))
    assert c["idle"] == pytest.approx(10_000 - end_a)
    assert sum(c.values()) == pytest.approx(book.wall_seconds, abs=1e-6)
    assert book.launched_seconds == pytest.approx(book.wall_seconds - c["idle"])
    assert book.effective_share == round(c["productive"] / book.launched_seconds, 4)
    assert book.effective_share > 0.6
    # Relaunched as a SLURM job: idle until its submit, then the queue.
    jobs = [JobTimes(-5.0, -1.0, end_a + 1.0), JobTimes(9_000.0, 9_990.0, None)]
    queued = ledger(events, metrics, jobs)
    assert queued.causes["idle"] == pytest.approx(9_000.0 - end_a)
    assert queued.causes["queue_wait"] == pytest.approx(4.0 + 990.0)
    assert sum(queued.causes.values()) == pytest.approx(queued.wall_seconds, abs=1e-6)


def in_job(part: tuple[list[dict], list[dict]], job_id: str = "7") -> tuple[list, list]:
    """in_job: an attempt's records as a SLURM job's trainer writes them (with its job id)."""
    return [{**e, "job_id": job_id} for e in part[0]], part[1]


def test_a_requeue_inside_a_job_or_a_job_killed_without_a_record_is_no_idle_time():
    a = attempt(0, 0, 20, stopped=True)
    events, metrics = run_of((finished(a[0], job_id="7"), a[1]), attempt(300, 20, 30))
    assert ledger(events, metrics).causes["idle"] == 0.0  # the job's own requeue
    # A node lost: SLURM requeued the job, which left no record, and it resumed.
    events, metrics = run_of(in_job(attempt(0, 0, 20)), in_job(attempt(300, 10, 30)))
    assert ledger(events, metrics).causes["idle"] == 0.0
    crashed = attempt(0, 0, 20)
    crashed[0].append({"event": "crash", "time": 22.5, "error": "boom", "job_id": "7"})
    events, metrics = run_of(crashed, in_job(attempt(300, 10, 30)))
    assert ledger(events, metrics).causes["idle"] == 0.0


@pytest.mark.parametrize("end", ["", "crash", "hang"])
def test_a_run_started_by_hand_and_killed_was_idle_until_it_was_started_again(end):
    """`kill -9` of a run started by hand (no record of its end), started again a day later:
    the day read as the ledger's remainder, 99.9% of the wall time, and the effective share
    fell to 0.04%. Outside a job nothing but its user starts the run again, as after a
    Ctrl-C's stop: the time from its last record to the next start is idle."""
    killed = attempt(0, 0, 20, ckpts=(10,))
    if end:
        killed[0].append({"event": end, "time": 22.5, "rank": 0, "seconds": 0.0})
    events, metrics = run_of(killed, attempt(86_400, 10, 30, stopped=True))
    book = ledger(events, metrics)
    last = 22.5 if end else 22.0  # its last record
    assert book.causes["idle"] == pytest.approx(86_400 - last)
    assert book.causes["remainder"] == pytest.approx(last - 22.0)  # its end after its last step
    assert sum(book.causes.values()) == pytest.approx(book.wall_seconds, abs=1e-6)
    assert book.launched_seconds == pytest.approx(book.wall_seconds - book.causes["idle"])
    assert book.effective_share is not None and book.effective_share > 0.5


def test_a_start_that_failed_before_choosing_a_checkpoint_spent_its_time_starting_up():
    """A start whose health check failed (or that ran out of memory building the model)
    spent its seconds to its newest start-up phase starting up, not in the remainder."""
    failed = [ph("process_start", 0.0), ph("imports_done", 6.0), ph("data_ready", 7.0),
              {"event": "health", "time": 7.5, "ok": False, "rank": 1},
              {"event": "requeue", "time": 9.0, "exit_code": 77}]
    book = ledger([*failed, *EVENTS], METRICS)
    assert book.causes["start_up"] == 7.0 + 10.0 + 2.0 + 8.0 + 1.0
    assert sum(book.causes.values()) == pytest.approx(book.wall_seconds, abs=1e-6)


class _CountedRows(list):
    """metrics.jsonl's rows, counting the passes made over them."""

    passes = 0

    def __iter__(self):
        type(self).passes += 1
        return super().__iter__()


def test_each_attempt_s_rows_are_found_in_one_pass_not_one_pass_per_attempt():
    """A run of 200 requeues and 200,000 logged steps took 25 s to show its status: every
    attempt went over every metrics row to find its own. Same ledger, a pass or two."""
    events, metrics = [], []
    for a in range(50):
        t = 100.0 * a
        events += [ph("process_start", t), ph("checkpoint_chosen", t + 1.0),
                   {"event": "resume" if a else "start", "time": t + 1.0, "step": 10 * a},
                   ph("first_step", t + 2.0), {"event": "stop", "time": t + 50.0,
                                                "step": 10 * a + 10}]
        metrics += [{"time": t + 2.0 + s, "step": 10 * a + s, "step_time": 1.0}
                    for s in range(1, 11)]
    expected = ledger(events, metrics)
    rows = _CountedRows(metrics)
    _CountedRows.passes = 0
    assert ledger(events, rows) == expected
    assert _CountedRows.passes <= 5


def test_a_job_that_ended_without_a_requeue_was_idle_until_a_new_job_was_launched():
    """Job 7 lost its node and was not requeued (no record of its end); its user launched the
    run again a day later as job 8: the day read as the remainder, as if SLURM had been
    restarting it. A new job is a new launch; the same job started again is SLURM's doing."""
    killed, later = attempt(0, 0, 20, ckpts=(10,)), attempt(86_400, 10, 30, stopped=True)
    book = ledger(*run_of(in_job(killed, "7"), in_job(later, "8")))
    assert book.causes["idle"] == pytest.approx(86_400 - 22.0)
    assert book.causes["remainder"] == pytest.approx(0.0, abs=1e-6)
    jobs = [JobTimes(-5.0, -1.0, 23.0), JobTimes(80_000.0, 86_399.0, None)]
    queued = ledger(*run_of(in_job(killed, "7"), in_job(later, "8")), jobs)
    assert queued.causes["idle"] == pytest.approx(80_000 - 22.0)
    assert queued.causes["queue_wait"] == pytest.approx(4.0 + 6_399.0)
    assert sum(queued.causes.values()) == pytest.approx(queued.wall_seconds, abs=1e-6)
    # Started again by hand, outside any job: the same.
    assert ledger(*run_of(in_job(killed, "7"), later)).causes["idle"] == pytest.approx(
        86_400 - 22.0)
    # Requeued by SLURM (the same job) or by its script: no idle time.
    assert ledger(*run_of(in_job(killed, "7"), in_job(later, "7"))).causes["idle"] == 0.0
