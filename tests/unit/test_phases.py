"""Phase timings read back: the newest interruption, in order, with the gaps between phases."""

from __future__ import annotations

import subprocess
import sys
import time

from pyrecover import phases
from pyrecover.rundir import RunDir


def ph(name: str, at: float) -> dict:
    return {"event": "phase", "phase": name, "time": at}


STOPPED = [ph("process_start", 0.0), ph("imports_done", 1.0), ph("first_step", 3.0),
           {"event": "checkpoint", "time": 5.0, "step": 10}, ph("signal_seen", 6.0),
           ph("stop_agreed", 6.5), ph("save_done", 7.0), {"event": "stop", "time": 7.0},
           ph("exit", 7.25)]
RESUMED = [ph("process_start", 19.0), ph("imports_done", 20.0), ph("group_up", 20.5),
           ph("checkpoint_chosen", 21.0), ph("restored", 21.5), ph("first_step", 22.0)]


def test_the_last_interruption_lists_the_stop_then_the_next_start_with_gaps():
    rows = phases.last_interruption(STOPPED + RESUMED)
    assert [r["phase"] for r in rows] == [
        "signal_seen", "stop_agreed", "save_done", "exit", "process_start", "imports_done",
        "group_up", "checkpoint_chosen", "restored", "first_step"]
    assert [r["gap"] for r in rows] == [0.0, 0.5, 0.5, 0.25, 11.75, 1.0, 0.5, 0.5, 0.5, 0.5]


def test_the_choice_of_the_checkpoint_says_where_its_seconds_went():
    """checkpoint_chosen's own times (the model built, the checksum pass beside it, the wait
    for that pass) come through to the interruption's rows and `pyrecover status`'s lines;
    a field of the wrong type is left out, as any record not as pyrecover writes it."""
    from pyrecover.status_text import _interruption_lines

    chosen = {**ph("checkpoint_chosen", 21.0), "built_s": 0.4, "verify_s": 0.7,
              "wait_s": 0.25, "step": 10}
    rows = phases.last_interruption(STOPPED + [*RESUMED[:3], chosen, *RESUMED[4:]])
    row = next(r for r in rows if r["phase"] == "checkpoint_chosen")
    assert {k: row[k] for k in phases.CHOICE_TIMES} == {"built_s": 0.4, "verify_s": 0.7,
                                                        "wait_s": 0.25}
    line = next(x for x in _interruption_lines(rows) if "checkpoint_chosen" in x)
    assert line.endswith("(model built 0.40s, checksums beside it 0.70s, then waited 0.25s)")
    chosen["verify_s"] = "0.7"
    rows = phases.last_interruption(STOPPED + [*RESUMED[:3], chosen, *RESUMED[4:]])
    assert "verify_s" not in next(r for r in rows if r["phase"] == "checkpoint_chosen")


def test_a_stop_not_yet_resumed_shows_its_stop_phases_only():
    rows = phases.last_interruption(STOPPED)
    assert [r["phase"] for r in rows] == ["signal_seen", "stop_agreed", "save_done", "exit"]


def test_a_killed_attempt_ends_at_its_last_record():
    killed = STOPPED[:4]
    rows = phases.last_interruption(killed + RESUMED)
    assert rows[0] == {"phase": "last_record", "time": 5.0, "gap": 0.0}
    assert rows[1]["phase"] == "process_start" and rows[1]["gap"] == 14.0


def test_a_killed_attempt_ends_at_its_last_step_not_at_what_the_job_script_said_after():
    """Steps logged after the attempt's last event (a long checkpoint interval) are signs of
    life; the job script's requeue record after the kill is not."""
    killed = [*STOPPED[:4], {"event": "requeue", "time": 15.0, "exit_code": 137}]
    metrics = [{"time": 5.0 + s, "step": 10 + s} for s in range(1, 5)]  # steps 11-14
    metrics.append({"time": 19.5, "step": 11})  # the resumed attempt's: not this one's
    rows = phases.last_interruption(killed + RESUMED, metrics)
    assert rows[0] == {"phase": "last_record", "time": 9.0, "gap": 0.0}
    assert rows[1]["phase"] == "process_start" and rows[1]["gap"] == 10.0


def test_a_crash_not_yet_restarted_is_the_last_interruption_not_the_stop_before_it():
    crashed = [*RESUMED, {"event": "crash", "time": 50.0, "rank": 0},
               {"event": "requeue", "time": 51.0, "exit_code": 1}]
    rows = phases.last_interruption(STOPPED + crashed)
    assert rows == [{"phase": "last_record", "time": 50.0, "gap": 0.0}]
    # Killed with no record of its own: the job script's decision says the attempt is over.
    killed = [*RESUMED, {"event": "requeue", "time": 51.0, "exit_code": 137}]
    metrics = [{"time": 30.0, "step": 12}]
    assert phases.last_interruption(STOPPED + killed, metrics) == [
        {"phase": "last_record", "time": 30.0, "gap": 0.0}]
    # Still running: the stop before it is the newest interruption.
    assert phases.last_interruption(STOPPED + RESUMED)[0]["phase"] == "signal_seen"


def test_a_run_never_interrupted_has_no_interruption():
    assert phases.last_interruption(STOPPED[:4]) == []


def test_marks_before_the_run_directory_exists_are_written_when_it_does(tmp_path):
    run = RunDir(tmp_path / "run")
    recorder = phases.Phases(rank=0)
    recorder.mark("process_start", phases.process_start_time())
    run.create()
    recorder.attach(run)
    recorder.mark("group_up")
    recorder.once("first_step")
    recorder.once("first_step")
    names = [e["phase"] for e in run.read_events()]
    assert names == ["process_start", "group_up", "first_step"]
    assert run.read_events()[0]["time"] <= time.time()


def test_other_ranks_write_nothing(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    recorder = phases.Phases(rank=1)
    recorder.attach(run)
    recorder.mark("group_up")
    assert not run.events.exists()


def test_the_process_start_time_is_when_the_process_was_started_not_imported():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; first = time.time(); "
                          "time.sleep(0.5); from pyrecover.phases import process_start_time "
                          "as p; print(p(), first)"],
                         capture_output=True, text=True, check=True)
    started, first = map(float, out.stdout.split())
    # After the spawn (within the kernel's 10 ms ticks), and before the child's first line,
    # which a busy machine may run seconds later; not at the import, half a second after it.
    assert before - 0.05 <= started < first + 0.25


def test_failure_to_first_step_runs_from_the_failure_s_first_record_to_the_next_first_step():
    from pyrecover.phases import failure_to_first_step

    def phase(name, t):
        return {"event": "phase", "phase": name, "time": t}

    crashed = [phase("process_start", 1.0), phase("first_step", 3.0),
               {"event": "crash", "time": 10.0}, {"event": "crash", "time": 10.5},
               {"event": "restart_in_job", "time": 11.0}, phase("process_start", 11.5),
               phase("first_step", 14.0)]
    assert failure_to_first_step(crashed) == 4.0
    killed = [e for e in crashed if e["event"] != "crash"]  # a SIGKILL leaves no record
    assert failure_to_first_step(killed) == 3.0
    health = [phase("process_start", 1.0), {"event": "health", "time": 2.0, "ok": True},
              {"event": "health", "time": 2.5, "ok": False}, {"event": "requeue", "time": 3.0},
              phase("process_start", 20.0), phase("first_step", 22.0)]
    assert failure_to_first_step(health) == 19.5
    assert failure_to_first_step(crashed[:5]) is None and failure_to_first_step([]) is None


def test_another_rank_s_record_written_before_rank_0_s_start_up_phases_is_of_that_start():
    # Rank 1's failed health check reached the file before rank 0 wrote its held-back phases
    # (with their earlier times): one start, not a start that "ended during start-up" more.
    events = [{"event": "health", "rank": 1, "ok": False, "time": 127.4},
              {"event": "phase", "phase": "process_start", "time": 125.9},
              {"event": "phase", "phase": "imports_done", "time": 127.3},
              {"event": "requeue", "time": 133.0, "reason": "health check failed"},
              {"event": "phase", "phase": "process_start", "time": 145.0},
              {"event": "start", "time": 148.7, "step": 0}]
    runs = phases.attempts(events)
    assert [len(a) for a in runs] == [4, 2]
    # A record from before the start it precedes (an earlier attempt's) stays apart.
    earlier = [{"event": "health", "rank": 1, "ok": False, "time": 120.0}, *events[1:]]
    assert [len(a) for a in phases.attempts(earlier)] == [1, 3, 2]


def test_another_rank_s_record_before_a_requeued_start_s_phases_is_of_that_start_too():
    """The same after a requeue: rank 1's failed check of the second start is that start's,
    not the first's, whose job script decision came before it; the script's records stay."""
    events = [{"event": "phase", "phase": "process_start", "time": 100.0},
              {"event": "crash", "rank": 0, "time": 110.0},
              {"event": "requeue", "time": 111.0, "reason": "crash"},
              {"event": "health", "rank": 1, "ok": False, "time": 127.4},
              {"event": "phase", "phase": "process_start", "time": 125.9},
              {"event": "phase", "phase": "imports_done", "time": 127.3},
              {"event": "requeue", "time": 133.0, "reason": "health check failed"}]
    runs = phases.attempts(events)
    assert [[e["time"] for e in a] for a in runs] == [[100.0, 110.0, 111.0],
                                                      [127.4, 125.9, 127.3, 133.0]]
