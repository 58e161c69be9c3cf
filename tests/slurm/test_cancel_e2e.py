"""`pyrecover cancel` on a real local SLURM cluster when SLURM takes only half of it.

The cancel is two commands: `scontrol update Requeue=0` (so that the job script does not take
the cancel for a preemption and requeue itself), then `scancel`. A controller may refuse the
first (a site's policy, a job it will not change) and still take the second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from localslurm import LocalSlurm

pytestmark = pytest.mark.slurm

SLEEPER = "#!/bin/bash\nsleep 300\n"


def stand_in(folder: Path, cluster: LocalSlurm, command: str, refusal: str) -> dict[str, str]:
    """stand_in is an environment whose `command` runs the shell lines `refusal` first (they
    exit where SLURM would refuse) and is the real command otherwise."""
    real = shutil.which(command, path=cluster.client_env()["PATH"])
    folder.mkdir()
    script = folder / command
    script.write_text(f'#!/bin/bash\n{refusal}exec "{real}" "$@"\n')
    script.chmod(0o755)
    env = cluster.client_env()
    env["PATH"] = os.pathsep.join([str(folder), env["PATH"]])
    return env


def refusing_scontrol(folder: Path, cluster: LocalSlurm) -> dict[str, str]:
    """An environment whose `scontrol` refuses every `update` as a controller that does not
    allow it answers, and is the real scontrol for everything else. It stands in for a site
    whose SLURM refuses the change: the local cluster, run by root here, never does."""
    return stand_in(folder, cluster, "scontrol",
                    'if [ "$1" = update ]; then\n'
                    '    echo "slurm_update error: Access/permission denied" >&2\n'
                    "    exit 1\n"
                    "fi\n")


def refusing_scancel(folder: Path, cluster: LocalSlurm) -> dict[str, str]:
    """An environment whose `scancel` refuses the first job it is asked to cancel (and writes
    its id to folder/refused), as a controller answers for a job it will not cancel, and is
    the real scancel afterwards. It stands in for a refusal the local cluster, run by root,
    never gives."""
    return stand_in(folder, cluster, "scancel",
                    f'if [ ! -e "{folder}/refused" ]; then\n'
                    f'    echo "$1" > "{folder}/refused"\n'
                    '    echo "scancel: error: Kill job error on job id $1: Access/permission '
                    'denied" >&2\n'
                    "    exit 1\n"
                    "fi\n")


def run_with_job(cluster: LocalSlurm, tmp_path: Path, *sbatch_args: str) -> tuple[Path, int]:
    """A run directory whose job.sbatch (a sleep) is queued as a launch would queue it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").touch()  # what marks a run directory
    script = run_dir / "job.sbatch"
    script.write_text(SLEEPER)
    out = cluster.run("sbatch", "--parsable", "--requeue", "-o", str(tmp_path / "job.out"),
                      *sbatch_args, str(script))
    return run_dir, int(out.stdout.strip().split(";")[0])


def cancel(run_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyrecover", "cancel", str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_running_job_scontrol_would_not_make_non_requeueable_is_said_and_fails_the_cancel(
        local_slurm, jobs, tmp_path):
    """scancel took the job, but its script takes that for a preemption and requeues: the
    cancel is not for good, and the user has to hear it (it was dropped: exit 0, no word)."""
    run_dir, job_id = run_with_job(local_slurm, tmp_path)
    jobs.append(job_id)
    local_slurm.wait_job(job_id, states=("RUNNING",), timeout=60)
    done = cancel(run_dir, refusing_scontrol(tmp_path / "bin", local_slurm))
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"error: job {job_id} was cancelled, but scontrol did not make it non-requeueable "
        "(slurm_update error: Access/permission denied): its job script takes the cancel for "
        "a preemption and may requeue itself; if `pyrecover status` shows it queued again, "
        f"`scancel {job_id}` while it waits ends it for good")
    assert "Traceback" not in done.stderr


def test_a_waiting_job_is_cancelled_for_good_though_scontrol_refused_and_the_user_hears_it(
        local_slurm, jobs, tmp_path):
    """A job that never started runs no script that could requeue it: cancelled for good,
    with a note of what scontrol said."""
    run_dir, job_id = run_with_job(local_slurm, tmp_path, "--hold")
    jobs.append(job_id)
    done = cancel(run_dir, refusing_scontrol(tmp_path / "bin", local_slurm))
    assert done.returncode == 0, done.stderr
    assert local_slurm.wait_job(job_id, timeout=60) == "CANCELLED"
    assert f"cancelled job {job_id} (PENDING): it was waiting in the queue" in done.stderr
    assert (f"note: scontrol did not make job {job_id} non-requeueable (slurm_update error: "
            "Access/permission denied); it had not started, so nothing requeues it"
            ) in done.stderr


def test_a_job_scancel_refuses_is_said_the_others_are_cancelled_and_only_they_recorded(
        local_slurm, jobs, tmp_path):
    """A run with two queued jobs: scancel refusing the first left the second queued, and
    the refused job's `cancel` was in the run's events (written before scancel ran), so
    `status` said cancelled of a job still queued."""
    from pyrecover.rundir import read_jsonl

    run_dir, first = run_with_job(local_slurm, tmp_path, "--hold")
    jobs.append(first)
    second = int(local_slurm.run("sbatch", "--parsable", "--hold", "-o", str(tmp_path / "2.out"),
                                 str(run_dir / "job.sbatch")).stdout.strip().split(";")[0])
    jobs.append(second)
    done = cancel(run_dir, refusing_scancel(tmp_path / "bin", local_slurm))
    refused = (tmp_path / "bin" / "refused").read_text().strip()
    [taken] = {str(first), str(second)} - {refused}
    assert done.returncode == 2, done.stderr
    assert (f"error: could not cancel job {refused}: scancel: error: Kill job error on job id "
            f"{refused}: Access/permission denied") in done.stderr.splitlines(), done.stderr
    assert f"cancelled job {taken} (PENDING)" in done.stderr
    assert local_slurm.wait_job(taken, timeout=60) == "CANCELLED"
    assert local_slurm.job_state(refused) == "PENDING"
    recorded = [e["job_id"] for e in read_jsonl(run_dir / "events.jsonl")
                if e["event"] == "cancel"]
    assert recorded == [taken]
    assert "Traceback" not in done.stderr


def test_a_sweep_array_scancel_refuses_leaves_the_others_cancelled_and_its_trials_unrecorded(
        local_slurm, jobs, tmp_path):
    """A sweep with two queued arrays (a relaunch's and the first): scancel refusing one
    stopped the command before the other, and its trials' `cancel` records were written
    before scancel ran."""
    from pyrecover.rundir import read_jsonl

    sweep_dir = tmp_path / "sweep"
    for trial in ("trial-0", "trial-1"):
        (sweep_dir / trial).mkdir(parents=True)
    (sweep_dir / "sweep.yaml").write_text("{}\n")  # what marks a sweep's folder
    (sweep_dir / "job.sbatch").write_text(SLEEPER)
    arrays = [int(local_slurm.run("sbatch", "--parsable", "--hold", "--array=0-1", "-o",
                                  str(tmp_path / f"{i}-%a.out"), str(sweep_dir / "job.sbatch")
                                  ).stdout.strip().split(";")[0]) for i in range(2)]
    jobs.extend(arrays)
    done = cancel(sweep_dir, refusing_scancel(tmp_path / "bin", local_slurm))
    refused = (tmp_path / "bin" / "refused").read_text().strip()
    [taken] = {str(a) for a in arrays} - {refused}
    assert done.returncode == 2, done.stderr
    assert (f"error: could not cancel job array {refused}: scancel: error: Kill job error on "
            f"job id {refused}: Access/permission denied") in done.stderr.splitlines()
    assert f"cancelled job array {taken}: trial-0, trial-1 waiting in the queue" in done.stderr
    assert local_slurm.wait_job(f"{taken}_0", timeout=60) == "CANCELLED"
    assert local_slurm.job_state(f"{refused}_0") == "PENDING"
    for index in (0, 1):
        recorded = [e["job_id"] for e in read_jsonl(sweep_dir / f"trial-{index}" /
                                                    "events.jsonl") if e["event"] == "cancel"]
        assert recorded == [f"{taken}_{index}"]
    assert "Traceback" not in done.stderr


def test_a_sweep_whose_array_has_an_ended_task_is_cancelled_for_good_with_no_error(
        local_slurm, jobs, tmp_path):
    """One trial cancelled first (`pyrecover cancel SWEEP/trial-1`): scontrol's Requeue=0 of
    the whole array then answers "Job has already finished" for that task, and the sweep's
    cancel said the array may requeue itself (exit 1), though every live task was changed."""
    sweep_dir = tmp_path / "sweep"
    (sweep_dir / "trial-0").mkdir(parents=True)
    (sweep_dir / "sweep.yaml").write_text("{}\n")
    (sweep_dir / "job.sbatch").write_text(SLEEPER)
    array = int(local_slurm.run("sbatch", "--parsable", "--array=0-1", "-o",
                                str(tmp_path / "%a.out"), str(sweep_dir / "job.sbatch")
                                ).stdout.strip().split(";")[0])
    jobs.append(array)
    local_slurm.wait_job(f"{array}_0", states=("RUNNING",), timeout=60)
    local_slurm.cancel(f"{array}_1")
    local_slurm.wait_job(f"{array}_1", timeout=60)
    done = cancel(sweep_dir, local_slurm.client_env())
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(f"cancelled job array {array}: trial-0 (RUNNING) saves"), \
        done.stderr
    assert local_slurm.job_info(f"{array}_0")["Requeue"] == "0"


def test_a_job_scancel_refuses_is_left_requeueable(local_slurm, jobs, tmp_path):
    """Requeue=0 came first and stayed: the job, never cancelled, then took its next
    preemption or time limit for a cancel (its script reads Requeue=0) and ended for good."""
    run_dir, job_id = run_with_job(local_slurm, tmp_path, "--hold")
    jobs.append(job_id)
    done = cancel(run_dir, refusing_scancel(tmp_path / "bin", local_slurm))
    assert done.returncode == 2, done.stderr
    assert local_slurm.job_info(job_id)["Requeue"] == "1"


def test_a_sweep_array_scontrol_would_not_change_is_said_as_a_runs_job_is(
        local_slurm, jobs, tmp_path):
    """A sweep's cancel says scontrol's refusal in the words a run's cancel uses: a note where
    no task of the array had started (exit 0), an error where one runs (exit 1)."""
    sweep_dir = tmp_path / "sweep"
    for trial in ("trial-0", "trial-1"):
        (sweep_dir / trial).mkdir(parents=True)
    (sweep_dir / "sweep.yaml").write_text("{}\n")
    (sweep_dir / "job.sbatch").write_text(SLEEPER)
    env = refusing_scontrol(tmp_path / "bin", local_slurm)
    waiting = int(local_slurm.run("sbatch", "--parsable", "--hold", "--array=0-1", "-o",
                                  str(tmp_path / "w-%a.out"), str(sweep_dir / "job.sbatch")
                                  ).stdout.strip().split(";")[0])
    jobs.append(waiting)
    done = cancel(sweep_dir, env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        f"cancelled job array {waiting}: trial-0, trial-1 waiting in the queue will not start; "
        f"`pyrecover sweep status {sweep_dir}` shows when they have ended",
        f"note: scontrol did not make job {waiting} non-requeueable (slurm_update error: "
        "Access/permission denied); it had not started, so nothing requeues it"]

    running = int(local_slurm.run("sbatch", "--parsable", "--requeue", "--array=0", "-o",
                                  str(tmp_path / "r-%a.out"), str(sweep_dir / "job.sbatch")
                                  ).stdout.strip().split(";")[0])
    jobs.append(running)
    local_slurm.wait_job(f"{running}_0", states=("RUNNING",), timeout=60)
    done = cancel(sweep_dir, env)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        f"error: job {running} was cancelled, but scontrol did not make it non-requeueable "
        "(slurm_update error: Access/permission denied): its job script takes the cancel for "
        "a preemption and may requeue itself; if `pyrecover status` shows it queued again, "
        f"`scancel {running}` while it waits ends it for good"]


@pytest.fixture
def own_slurm(tmp_path_factory: pytest.TempPathFactory):
    """A cluster of this test's own: its controller is stopped, which the session's cluster
    must never be."""
    from conftest import started_cluster

    yield from started_cluster(tmp_path_factory.mktemp("ctld"), nodes=1)


def controller_goes_away(folder: Path, cluster: LocalSlurm) -> dict[str, str]:
    """An environment whose `scontrol update` (cancel's first command after its squeue) stops
    the cluster's slurmctld by its recorded PID, waits until it is gone, and then runs the
    real scontrol: the controller goes away after squeue answered and before scancel. A shim
    because nothing else is deterministic: cancel runs squeue, scontrol and scancel in one
    process without a pause between them, and this is the one moment between the two."""
    from localslurm_daemons import load_records

    pid = load_records(cluster.pids_path)["slurmctld"]["pid"]
    return stand_in(folder, cluster, "scontrol",
                    'if [ "$1" = update ]; then\n'
                    f"    kill {pid}\n"  # gone once reaped (a zombie still answers kill -0)
                    f"    while [ -e /proc/{pid} ] && [ \"$(cut -d')' -f2 /proc/{pid}/stat |"
                    " cut -c2)\" != Z ]; do sleep 0.1; done\n"
                    "fi\n")


@pytest.mark.parametrize("kind", ["run", "sweep"])
def test_slurm_going_away_between_squeue_and_scancel_is_a_fault_exit_1_in_one_line(
        own_slurm, tmp_path, kind):
    """The controller stopped after cancel's squeue listed the job: scancel then could not
    reach it, and cancel said `could not cancel` with exit 2, the code of a mistake in the
    command. SLURM's silence is a fault of the cluster (exit 1), as when squeue fails."""
    folder = tmp_path / kind
    (folder / "trial-0").mkdir(parents=True)
    if kind == "run":
        (folder / "events.jsonl").touch()
    else:
        (folder / "sweep.yaml").write_text("{}\n")
    (folder / "job.sbatch").write_text(SLEEPER)
    job = own_slurm.run("sbatch", "--parsable", "--hold", "--requeue", "-o",
                        str(tmp_path / "%j.out"), *(["--array=0"] if kind == "sweep" else []),
                        str(folder / "job.sbatch")).stdout.strip().split(";")[0]
    done = cancel(folder, controller_goes_away(tmp_path / "bin", own_slurm))
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: SLURM did not answer while job {job} was being "
                                  "cancelled (scancel: error: Kill job error on job id "
                                  f"{job}: Unable to contact slurm controller"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


SAVER = ("#!/bin/bash\n"  # a trainer's stop: on SIGTERM it saves (until `release` appears)
         'trap \'until [ -e "$RELEASE" ]; do sleep 0.1; done; exit 75\' TERM\n'
         "sleep 300 &\nwait\n")


def test_cancel_typed_again_while_the_first_one_s_save_runs_is_no_error(
        local_slurm, jobs, tmp_path):
    """The stop's save runs while SLURM lists the job COMPLETING, and scontrol then answers
    "Job has already finished": a second `pyrecover cancel` took that for a job that may
    requeue itself (error, exit 1), though the first had made it non-requeueable."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = run_dir / "job.sbatch"
    script.write_text(SAVER)
    env = {**local_slurm.client_env(), "RELEASE": str(tmp_path / "release")}
    out = subprocess.run(["sbatch", "--parsable", "--requeue", "-o", str(tmp_path / "job.out"),
                          str(script)], env=env, capture_output=True, text=True, check=True)
    job_id = int(out.stdout.strip().split(";")[0])
    jobs.append(job_id)
    local_slurm.wait_job(job_id, states=("RUNNING",), timeout=60)
    (run_dir / "events.jsonl").write_text(
        f'{{"event": "start", "time": 1.0, "step": 0, "job_id": "{job_id}"}}\n')
    first = cancel(run_dir, env)
    assert first.returncode == 0, first.stderr
    while local_slurm.run("squeue", "-h", "-j", str(job_id), "-o", "%T").stdout.strip() != (
            "COMPLETING"):  # the save runs
        pass
    again = cancel(run_dir, env)
    (tmp_path / "release").touch()
    assert again.returncode == 0, again.stderr
    assert again.stderr.splitlines() == [
        f"job {job_id} is already ending: `pyrecover cancel` cancelled it for good before (it "
        "saves a checkpoint and is not requeued); `pyrecover status` shows when it has ended"]
    assert local_slurm.wait_job(job_id, timeout=60) == "CANCELLED"
