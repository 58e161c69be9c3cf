"""The job script's decisions, run by a real bash with `srun`, `scontrol` and `sinfo`
replaced by stand-ins (test_render.run_step): the CPUs each task gets, which requeues use up
max_restarts, the stop signal in the batch shell, and which nodes the requeued job excludes."""

from __future__ import annotations

import dataclasses

import pytest
from test_render import run_step, spec_for

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
