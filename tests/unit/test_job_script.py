"""The job script's decisions, run by a real bash with `srun`, `scontrol` and `sinfo`
replaced by stand-ins (test_render.run_step): the CPUs each task gets, which requeues use up
max_restarts, the stop signal in the batch shell, and which nodes the requeued job excludes."""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess

import pytest
from sbatch_support import run_step, spec_for
from test_bad_nodes import decisions, lines, run_job

from pyrecover.slurm import render


@pytest.mark.parametrize("launcher, cpus, expected", [
    ("srun", 8, "--cpus-per-task=8"),      # one task per GPU: the profile's CPUs per task
    ("none", 8, "--cpus-per-task=8"),
    ("torchrun", 8, "--cpus-per-task=32"),  # one task per node: its 4 GPUs' CPUs
    ("spawn", 8, "--cpus-per-task=32"),
    ("torchrun", None, "--cpus-per-task=4"),  # the allocation's 4 tasks x 1 CPU per node
    ("spawn", None, "--cpus-per-task=4"),
])
def test_srun_asks_for_the_cpus_the_allocation_holds_for_each_task(launcher, cpus, expected,
                                                                     tmp_path):
    # srun takes no --cpus-per-task from sbatch since SLURM 22.05: a task would get one CPU.
    spec = dataclasses.replace(spec_for(launcher), cpus_per_task=cpus)
    argv, stderr, code = run_step(render.render(spec), tmp_path)
    assert code == 0, stderr
    assert [w for w in argv if w.startswith("--cpus-per-task")] == [expected]


def test_srun_without_cpus_per_task_leaves_srun_its_default_of_one_per_task(tmp_path):
    spec = dataclasses.replace(spec_for("srun"), cpus_per_task=None)
    argv, stderr, code = run_step(render.render(spec), tmp_path)
    assert code == 0, stderr
    assert not [w for w in argv if w.startswith("--cpus-per-task")]


@pytest.mark.parametrize("spares, flagged", [(1, True), (0, False)])
def test_with_spare_nodes_a_failed_node_does_not_end_the_job(spares, flagged):
    # SLURM ends the whole job when one of its nodes fails, unless --no-kill: the spare
    # would never get its turn.
    options = render.sbatch_options(spec_for("none", spare_nodes=spares))
    assert ("no-kill" in options) is flagged
    assert options.get("no-kill") is None


# ------------------------------------------------------------- max_restarts counts failures


def trainer(event: str, step: int, restart: int, **fields) -> dict:
    """A trainer's record of the job's attempt `restart` (rundir.RunDir.event's key order)."""
    return {"event": event, "time": 5.0, "step": step, **fields, "job_id": "123",
            "restart_count": restart, "in_job_restart": 0, "host": "h"}


def decision(reason: str, restart: int, job: str = "123", code: int = 75) -> dict:
    """An earlier requeue the job script recorded (blocks.record's key order)."""
    return {"event": "requeue", "time": 1.0, "job_id": job, "restart_count": restart,
            "in_job_restart": 0, "exit_code": code, "reason": reason}


def attempt(earlier: list[dict], records: list[dict], code: int) -> str:
    """A training step (run_job's `steps`) of a job with `earlier` records in events.jsonl,
    that writes `records` and exits with `code`."""
    echo = [f"echo {shlex.quote(json.dumps(r))} >> \"$EVENTS\"" for r in [*earlier, *records]]
    return "\n".join([*echo, f"exit {code}", ""])


def test_clean_stops_that_trained_requeue_however_often_the_job_requeued_before(tmp_path):
    # A long run stops before every time limit: five requeues so far, max_restarts 3.
    earlier = [decision("stopped cleanly", k) for k in range(5)]
    step = attempt(earlier, [trainer("resume", 50, 5, path="p"),
                             trainer("stop", 60, 5, reason="SIGUSR2")], 75)
    done, run = run_job(tmp_path, [step], env={"SLURM_RESTART_COUNT": "5"})
    assert done.returncode == 75
    assert decisions(run)[5:] == [("requeue", 75, "stopped cleanly")]
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123"]


@pytest.mark.parametrize("failed_before, decided", [
    (2, ("requeue", 75, "stopped cleanly without progress")),
    (3, ("no_requeue", 75, "stopped cleanly without progress; max restarts (3) reached by "
                           "failures")),
])
def test_a_clean_stop_without_progress_counts_as_a_failure(tmp_path, failed_before, decided):
    # A stop that repeats at once (resumed at step 50, stopped at 50) would loop forever.
    earlier = [decision("crash", k, code=1) for k in range(failed_before)]
    step = attempt(earlier, [trainer("resume", 50, failed_before, path="p"),
                             trainer("stop", 50, failed_before, reason="SIGUSR2")], 75)
    done, run = run_job(tmp_path, [step], env={"SLURM_RESTART_COUNT": str(failed_before)})
    assert done.returncode == 75
    assert decisions(run)[failed_before:] == [decided]


@pytest.mark.parametrize("crashes_before, decided", [
    (2, ("requeue", 1, "crash")),
    (3, ("no_requeue", 1, "crash; max restarts (3) reached by failures")),
])
def test_crashes_use_up_max_restarts_counting_only_this_jobs_failures(tmp_path, crashes_before,
                                                                      decided):
    earlier = [decision("stopped cleanly", 0), decision("stopped cleanly", 1),
               *(decision("crash", 2 + k, code=1) for k in range(crashes_before)),
               *(decision("crash", k, job="99", code=1) for k in range(3))]  # another job's
    restart = 2 + crashes_before
    step = attempt(earlier, [trainer("resume", 5, restart, path="p")], 1)
    done, run = run_job(tmp_path, [step], env={"SLURM_RESTART_COUNT": str(restart)})
    assert done.returncode == 1
    assert decisions(run)[-1] == decided
    assert f"(restart {restart}, {crashes_before} failures of at most 3," in (
        run / "logs" / "123.out").read_text()


# ------------------------------------------------------------------- the stop signal


@pytest.mark.parametrize("stop_signal", ["USR2", "USR1"])
def test_the_stop_signal_sent_to_the_batch_shell_reaches_the_step_and_the_decision_follows(
        tmp_path, stop_signal):
    """`scancel -s USR2 --batch` signals the batch shell alone (`--full`, the tasks too): the
    shell ran its handler only once the step had ended, so the step never got the signal and
    trained on to its end; the shell must pass it on, and survive it to requeue the job."""
    spec = spec_for("none", sets=[f"run.storage={tmp_path / 'store'}", "run.exp_name=tiny-gpt",
                                  f"run.stop_signal={stop_signal}"])
    (tmp_path / "store" / "tiny-gpt" / "logs").mkdir(parents=True)  # where it records
    # The stand-in step signals the script's shell (its parent), then trains (sleeps) until
    # the signal comes back to it, as srun passes it on to its tasks, and exits as a stopped
    # trainer. It also reports its own mask of ignored signals (/proc: SigIgn).
    step = ("sleep 120 & nap=$!\n"
            f"trap 'got=1; kill $nap' {stop_signal}\n"
            f"kill -{stop_signal} \"$PPID\"\n"
            "wait $nap\n"
            "grep SigIgn /proc/$$/status >&2\n"
            "[ -n \"${got:-}\" ] || { echo 'the step never got the signal' >&2; exit 1; }\n"
            "exit 75\n")
    argv, stderr, code = run_step(render.render(spec), tmp_path, env={"STEP": step},
                                  srun_body='eval "$STEP"')
    assert code == 75, stderr
    assert f"batch shell got SIG{stop_signal}; passing it on to the training step" in stderr
    assert "pyrecover: requeueing job 123" in stderr
    assert (tmp_path / "scontrol.requeue").read_text().split() == ["123"]
    # A handler, not an ignore: the tasks the shell starts still take the signal.
    ignored = int(next(line for line in stderr.splitlines() if line.startswith("SigIgn:")
                       ).split()[1], 16)
    number = {"USR1": 10, "USR2": 12}[stop_signal]
    assert not ignored & (1 << (number - 1))


# ------------------------------------------------------------- damaged or full storage


def test_nul_bytes_in_the_events_file_do_not_hide_the_failures_from_the_restart_limit(
        tmp_path):
    """A node that died while appending leaves NULs in events.jsonl; GNU grep then takes the
    file for binary, printed no line, and every crash requeued for ever."""
    earlier = [decision("crash", k, code=1) for k in range(3)]
    nuls = "head -c 4096 /dev/zero >> \"$EVENTS\"\necho >> \"$EVENTS\"\n"
    step = nuls + attempt(earlier, [trainer("resume", 5, 3, path="p")], 1)
    done, run = run_job(tmp_path, [step], env={"SLURM_RESTART_COUNT": "3"})
    assert done.returncode == 1
    records = [json.loads(line) for line in lines(run / "events.jsonl") if line.startswith("{")]
    assert [(r["event"], r["reason"]) for r in records if "reason" in r][-1] == (
        "no_requeue", "crash; max restarts (3) reached by failures")
    assert lines(tmp_path / "scontrol.calls") == []


def test_a_requeue_that_cannot_be_recorded_ends_the_job_instead_of_requeueing_uncounted(
        tmp_path):
    """Storage full or read-only: the trainer fails, the requeue record cannot be written, and
    the restart limit, which counts those records, could never be reached."""
    unwritable = "rm -f \"$EVENTS\"\nmkdir \"$EVENTS\"\nexit 1\n"  # no file can be written there
    done, run = run_job(tmp_path, [unwritable])
    assert done.returncode == 1
    assert lines(tmp_path / "scontrol.calls") == []  # no requeue
    assert "this requeue could not be counted; not requeueing. Free the storage, then launch " \
        "the run again" in (run / "logs" / "123.out").read_text()


def test_a_clean_stop_requeues_even_where_its_requeue_cannot_be_recorded(tmp_path):
    """A long run stopping at its time limit while events.jsonl cannot take a line (over
    quota): clean stops are never counted, so it requeues all the same. The file is made
    immutable (chattr +i; root ignores permissions), still readable."""
    step = attempt([], [trainer("resume", 50, 0, path="p"),
                        trainer("stop", 60, 0, reason="SIGUSR2")], 75).replace(
        "exit 75", "chattr +i \"$EVENTS\"\nexit 75")
    try:
        done, run = run_job(tmp_path, [step])
    finally:
        for events in tmp_path.rglob("events.jsonl"):
            subprocess.run(["chattr", "-i", str(events)], check=False)
    assert "Operation not permitted" in (run / "logs" / "123.out").read_text()  # not recorded
    assert done.returncode == 75
    assert lines(tmp_path / "scontrol.calls")[0] == "requeue 123"


def test_a_task_failing_after_the_recorded_finish_ends_the_job_as_finished(tmp_path):
    """A rank aborting in its teardown (exit 134) after the final checkpoint and the `finish`
    record: no requeue, which would redo nothing and use up a restart."""
    step = attempt([], [trainer("start", 0, 0), trainer("finish", 8, 0, tokens_seen=512)], 134)
    done, run = run_job(tmp_path, [step])
    assert done.returncode == 0
    assert decisions(run) == [] and lines(tmp_path / "scontrol.calls") == []
    assert "a task exited with code 134 after the trainer recorded this attempt's finish" in (
        run / "logs" / "123.out").read_text()
