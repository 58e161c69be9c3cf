"""Finding a cluster profile and an image without flags, and writing a starting profile from
`sinfo` (`pyrecover launch --init-cluster PATH`)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from helpers import TINY, default_cluster, pyrecover

from pyrecover.slurm import LaunchError, profile, sinfo
from pyrecover.slurm.profile import ClusterProfile

LOCAL_SINFO = "debug*|gpu:4|infinite|4|2\n"  # tests/localslurm.py's cluster
SITE_SINFO = ("gpu|gpu:a100:4(S:0-1),tmpdisk:100|2-00:00:00|64|10\n"
              "cpu*|(null)|1:00:00|128|100\n"
              "gpu|gpu:a100:8(S:0-1)|2-00:00:00|64|2\n")


def test_the_profile_is_the_option_else_the_environment_else_the_users_file(tmp_path):
    user = tmp_path / ".config" / "pyrecover" / "cluster.yaml"
    env = {"PYRECOVER_CLUSTER": str(tmp_path / "env.yaml")}
    assert profile.find_profile("/opt.yaml", env, tmp_path) == Path("/opt.yaml")
    with pytest.raises(LaunchError, match=r"^PYRECOVER_CLUSTER='.*/env.yaml' names no file: "
                       "point it at a cluster profile YAML, unset it, or pass --cluster FILE$"):
        profile.find_profile(None, env, tmp_path)  # the variable is what to fix, not --cluster
    (tmp_path / "env.yaml").write_text("")
    assert profile.find_profile(None, env, tmp_path) == tmp_path / "env.yaml"
    with pytest.raises(LaunchError, match=r"--init-cluster ~/.config/pyrecover/cluster.yaml`$"):
        profile.find_profile(None, {}, tmp_path)
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert profile.find_profile(None, {}, tmp_path) == user


def test_the_image_is_the_profiles_else_the_environments_else_the_local_sif(tmp_path):
    env = {"PYRECOVER_IMAGE": "/images/env.sif"}
    set_ = ClusterProfile(image="/images/profile.sif")
    assert profile.find_image(set_, env, tmp_path).image == "/images/profile.sif"
    assert profile.find_image(ClusterProfile(), env, tmp_path).image == "/images/env.sif"
    assert profile.find_image(ClusterProfile(), {}, tmp_path).image is None
    (tmp_path / "pyrecover.sif").write_text("")
    assert profile.find_image(ClusterProfile(), {}, tmp_path).image == str(
        tmp_path / "pyrecover.sif")
    assert profile.find_image(ClusterProfile(launcher="none"), env, tmp_path).image is None


@pytest.mark.parametrize("text, expected", [
    (LOCAL_SINFO, [("debug", True, [(4, 4, 2)], "infinite")]),
    # A mixed partition: its node types, those with GPUs first, the most common first.
    (SITE_SINFO, [("gpu", False, [(4, 64, 10), (8, 64, 2)], "2-00:00:00"),
                  ("cpu", True, [(0, 128, 100)], "1:00:00")]),
    ("a*|gpu:2,gpu:h100:1|30:00|8|1\nnot a line\n", [("a", True, [(2, 8, 1)], "30:00")]),
    ("mix|(null)|1:00:00|32|50\nmix|gpu:4|1:00:00|32|3\nmix|gpu:4|1:00:00|32|1\n",
     [("mix", False, [(4, 32, 4), (0, 32, 50)], "1:00:00")]),
    ("", []),
])
def test_sinfo_lines_become_one_partition_each(text, expected):
    got = [(p.name, p.default, [(t.gpus, t.cpus, t.nodes) for t in p.types], p.time_limit)
           for p in sinfo.parse_sinfo(text)]
    assert got == expected


@pytest.mark.parametrize("text, partition, gpus, cpus, time", [
    (LOCAL_SINFO, "debug", 4, 1, "01:00:00"),
    # The partition with GPUs, not the default; written for its 10 four-GPU nodes, not the
    # 2 with 8, where a job of 3 nodes would pend forever.
    (SITE_SINFO, "gpu", 4, 16, "2-00:00:00"),
    (None, None, 4, None, "01:00:00"),
])
def test_the_starting_profile_loads_and_holds_what_sinfo_said(tmp_path, text, partition, gpus,
                                                              cpus, time):
    path = tmp_path / "sub" / "cluster.yaml"
    line = sinfo.init_profile(path, text, found=path)
    assert str(path) in line and line.endswith("then: pyrecover launch --nodes 2 --mode dcp")
    written = path.read_text()
    assert written.startswith("# A pyrecover cluster profile") and "launcher: srun" in written
    prof = profile.load_profile(path, tmp_path)
    profile.validate(prof)
    assert (prof.partition, prof.gpus_per_node, prof.cpus_per_task, prof.time) == (
        partition, gpus, cpus, time)
    mixed = "# gpu's nodes differ: 10 with 4 GPUs and 64 CPUs; 2 with 8 GPUs and 64 CPUs; " \
            "the keys below are for the 10 with 4 GPUs"
    assert (mixed in written.splitlines()) == (text == SITE_SINFO), written
    with pytest.raises(LaunchError, match="already exists"):
        sinfo.init_profile(path, text)


def test_launch_without_a_profile_is_one_line_naming_init_cluster_which_then_works(tmp_path):
    env = {"HOME": str(tmp_path), "PATH": str(Path(sys.executable).parent)}  # no sinfo here
    done = pyrecover("launch", "--nodes", "2", "--mode", "dcp", "--dry-run", env=env,
                     cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "error: no cluster profile: pass --cluster FILE, set PYRECOVER_CLUSTER, or write "
        "~/.config/pyrecover/cluster.yaml with `pyrecover launch --init-cluster "
        "~/.config/pyrecover/cluster.yaml`"]

    done = pyrecover("launch", "--init-cluster", str(tmp_path / ".config/pyrecover/cluster.yaml"),
                     env=env, cwd=tmp_path)
    assert done.returncode == 0 and "with the defaults (sinfo did not answer)" in done.stdout
    assert done.stdout.rstrip().endswith("then: pyrecover launch --nodes 2 --mode dcp")
    done = pyrecover("launch", "--nodes", "2", "--mode", "dcp", "--launcher", "none",
                     "--dry-run", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2" in done.stdout and "#SBATCH --ntasks-per-node=4" in done.stdout
    assert "note: train.global_batch_size=auto:16: 64 sequences chosen" in done.stderr


def test_init_cluster_elsewhere_suggests_the_launch_that_finds_it(tmp_path):
    """A profile written where launch does not look by itself: the launch it suggests names
    it with --cluster, and works as printed."""
    env = {"HOME": str(tmp_path), "PATH": str(Path(sys.executable).parent)}  # no sinfo here
    elsewhere = tmp_path / "my profiles" / "site.yaml"
    done = pyrecover("launch", "--init-cluster", str(elsewhere), env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    suggested = done.stdout.rstrip().split("then: ", 1)[1]
    assert suggested == f"pyrecover launch --cluster {shlex.quote(str(elsewhere))} --nodes 2 " \
                        "--mode dcp"
    done = pyrecover(*shlex.split(suggested)[1:], "--launcher", "none", "--dry-run", env=env,
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2" in done.stdout


def test_init_cluster_with_launch_options_refuses_rather_than_ignoring_them(tmp_path):
    env = {"HOME": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    target = tmp_path / "prof.yaml"
    done = pyrecover("launch", "--init-cluster", str(target), "--nodes", "3", "--partition",
                     "foo", env=env, cwd=tmp_path)
    assert done.returncode == 2 and not target.exists()
    assert done.stderr.splitlines() == [
        "error: --init-cluster writes a starting profile from sinfo and launches nothing, so "
        "--nodes, --partition would be ignored: run it alone, then set them in the profile or "
        "give them to the launch"]


@pytest.mark.parametrize("partition, nodes, gpus, said", [
    ("gpu", 10, 4, None),
    ("gpu", 12, 4, None),  # 12 fit: 10 with 4 GPUs and 2 with 8
    ("gpu", 3, 8, "partition gpu has 2 node(s) with 8 or more GPUs (sinfo), and this job "
                  "asks for 3: SLURM would keep it pending for good"),
    ("gpu", 13, 4, "partition gpu has 12 node(s) with 4 or more GPUs"),
    (None, 1, 4, "partition cpu has 0 node(s) with 4 or more GPUs"),  # the default: no GPUs
    ("nowhere", 99, 4, None),  # a partition sinfo does not show: no guess
])
def test_a_job_the_partition_cannot_hold_is_named(partition, nodes, gpus, said):
    problem = sinfo.fit_problem(sinfo.parse_sinfo(SITE_SINFO), partition, nodes, gpus)
    if said is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(said), problem


def test_launch_notes_a_job_that_could_never_start(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text(f"#!/bin/bash\nprintf '%s' {shlex.quote(LOCAL_SINFO)}\n")
    (bin_dir / "sinfo").chmod(0o755)
    env = {"HOME": str(tmp_path), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin"}
    done = pyrecover("launch", "--nodes", "3", "--launcher", "none", "--dry-run",
                     env={**env, **default_cluster(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "note: partition debug has 2 node(s) with 4 or more GPUs (sinfo), and this job " \
        "asks for 3: SLURM would keep it pending for good" in done.stderr


def test_sweep_launch_says_the_same_notes_for_its_array_and_each_swept_data_path(tmp_path,
                                                                                 corpus):
    """sweep launch said none of them: an array of trials that could never start, or whose
    swept data file is not here, queued without a word."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text(f"#!/bin/bash\nprintf '%s' {shlex.quote(LOCAL_SINFO)}\n")
    (bin_dir / "sinfo").chmod(0o755)
    missing = tmp_path / "elsewhere.parquet"
    sweep = tmp_path / "data.yaml"
    sweep.write_text(f"method: grid\nparameters:\n  data.path: {{values: [{corpus}, "
                     f"{missing}]}}\n")
    env = {"HOME": str(tmp_path), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin"}
    done = pyrecover("sweep", "launch", str(sweep), "--config", str(TINY), "--nodes", "3",
                     "--launcher", "none", "--dry-run", "--set", "train.global_batch_size=24",
                     "--set", f"run.storage={tmp_path / 'st'}",
                     env={**env, **default_cluster(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if line.startswith("note: ")]
    assert notes == [
        f"note: data.path {missing} does not exist here; the job will need it on the compute "
        "nodes",
        "note: partition debug has 2 node(s) with 4 or more GPUs (sinfo), and this job asks "
        "for 3: SLURM would keep it pending for good; check --nodes, --gpus-per-node"
    ], done.stderr  # (no --spare-nodes, which sweep launch lacks)


@pytest.mark.parametrize("under", ["cluster.yaml", "sub/cluster.yaml"])
def test_init_cluster_under_a_file_names_the_file_in_the_way(tmp_path, under):
    """A folder of the path that is a file: it said `cannot write notes/cluster.yaml: File
    exists`, the OS's words, naming neither the file in the way nor what to do."""
    env = {"HOME": str(tmp_path), "PATH": str(Path(sys.executable).parent)}  # no sinfo here
    (tmp_path / "notes").write_text("mine\n")
    done = pyrecover("launch", "--init-cluster", f"notes/{under}", env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: cannot write notes/{under}: notes is a file, not a folder; name a path in a "
        "folder, e.g. --init-cluster cluster.yaml"]
    assert (tmp_path / "notes").read_text() == "mine\n"
