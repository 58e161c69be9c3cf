"""Cluster profiles: the shipped ones load and validate, an unknown key is named, times and
binds are checked as SLURM and apptainer read them, and command-line options override them."""

from __future__ import annotations

import pytest
from sbatch_support import EXAMPLE, FIXED_CWD, LOCAL, spec_for

from pyrecover.slurm import LaunchError, profile


def test_the_shipped_profiles_load_and_validate():
    for path in (LOCAL, EXAMPLE):
        profile.validate(profile.load_profile(path, FIXED_CWD))
    local = profile.load_profile(LOCAL, FIXED_CWD)
    assert (local.partition, local.launcher, local.nodes) == ("debug", "none", 2)
    example = profile.load_profile(EXAMPLE, FIXED_CWD)
    assert example.gpus_per_node == 4 and example.image.endswith(".sif")
    assert example.binds == (profile.Bind("/scratch/datasets", "/scratch/datasets"),)


def test_an_unknown_profile_key_is_named_with_the_known_ones(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("partition: gpu\ngpus: 4\n")
    with pytest.raises(LaunchError) as info:
        profile.load_profile(path, tmp_path)
    message = str(info.value)
    assert "unknown cluster profile key 'gpus'" in message
    assert "gpus_per_node" in message and "signal_seconds" in message


def test_profile_times_stay_strings_even_where_yaml_would_read_base_60(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("time: 1:00:00\nnodes: 3\ncpus_per_task: ~\nbinds: data\n")
    prof = profile.load_profile(path, tmp_path)
    assert (prof.time, prof.nodes, prof.cpus_per_task) == ("1:00:00", 3, None)
    assert prof.binds == (profile.Bind(str(tmp_path / "data"), str(tmp_path / "data")),)


def test_command_line_options_override_the_profile_and_add_binds(tmp_path):
    base = profile.load_profile(EXAMPLE, tmp_path)
    prof = profile.with_overrides(base, tmp_path, binds=("rel:/in",), nodes=3, time="30",
                                  partition=None, image="img.sif")
    assert (prof.nodes, prof.time, prof.partition) == (3, "30", "gpu")
    assert prof.image == str(tmp_path / "img.sif")
    assert prof.binds[-1] == profile.Bind(str(tmp_path / "rel"), "/in")


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("90:30", 5430), ("2:00:00", 7200), ("1-0", 86400), ("1-2", 93600),
    ("1-02:30", 95400), ("2-00:00:10", 172810), ("infinite", None), ("UNLIMITED", None),
    ("-1", None), ("0", None),
])
def test_slurm_time_forms_are_accepted(text, seconds):
    assert profile.time_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "1:2:3:4", "1h", "1-", "-1-2", "1-2:3:4:5", "1.5",
                                  "1 day", "forever", "1-02:30\n"])
def test_time_strings_slurm_rejects_are_refused(text):
    with pytest.raises(LaunchError, match="time="):
        profile.time_seconds(text)


@pytest.mark.parametrize("bind", ["", ":/x", "a:", "a:rel", "a:/b:/c", "a,b", "a:/b:ro:x"])
def test_malformed_binds_are_refused(bind):
    with pytest.raises(LaunchError, match="bind"):
        profile.parse_bind(bind, "/cwd")


def test_binds_are_absolute_with_the_destination_spelled_out():
    assert profile.parse_bind("data", "/cwd") == profile.Bind("/cwd/data", "/cwd/data")
    assert profile.parse_bind("/d:/in:ro", "/cwd").spec() == "/d:/in:ro"


def test_a_profile_path_starting_with_a_tilde_is_under_the_home_folder(tmp_path, monkeypatch):
    """YAML (`binds: [~/datasets]`), and bash in `--bind=~/x`, leave the tilde as it is: the
    bind's source was <launch folder>/~/datasets, which the job's apptainer then failed to
    mount on every node, and the job requeued as a crash."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "site.yaml"
    path.write_text("partition: gpu\nimage: ~/pyrecover.sif\nbinds: [~/datasets]\n")
    loaded = profile.load_profile(path, tmp_path / "launch")
    assert loaded.image == str(tmp_path / "home" / "pyrecover.sif")
    home_data = str(tmp_path / "home" / "datasets")
    assert [(b.src, b.dst) for b in loaded.binds] == [(home_data, home_data)]
    added = profile.parse_bind("~/scratch:/scratch", tmp_path)
    assert added.src == str(tmp_path / "home" / "scratch") and added.dst == "/scratch"


@pytest.mark.parametrize("where", ["option", "variable"])
def test_a_cluster_profile_named_with_a_tilde_is_found_in_the_home_folder(tmp_path, monkeypatch,
                                                                         where):
    """`--cluster=~/site.yaml` (bash expands no tilde after `--cluster=`) was said not to
    exist, as was PYRECOVER_CLUSTER='~/site.yaml'."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "site.yaml").write_text("partition: gpu\n")
    monkeypatch.setenv("HOME", str(home))
    option, environ = ("~/site.yaml", {}) if where == "option" else (
        None, {profile.PROFILE_ENV: "~/site.yaml"})
    found = profile.find_profile(option, environ, tmp_path / "other")
    assert found == home / "site.yaml"
    assert profile.resolve(option, environ, tmp_path / "other", tmp_path).partition == "gpu"


def test_launcher_srun_without_an_image_says_what_to_do():
    with pytest.raises(LaunchError, match="--image"):
        spec_for("srun", image=None)


@pytest.mark.parametrize("empty", ["~", "null", "", "[]"])
def test_an_empty_binds_or_sbatch_extra_is_no_entry_not_a_folder_named_so(tmp_path, empty):
    # `binds: ~` is YAML's null, as `partition: ~` is: no bind, not the home folder (nor
    # ./null), which apptainer would then mount into every task.
    path = tmp_path / "site.yaml"
    path.write_text(f"binds: {empty}\nsbatch_extra: {empty}\n")
    prof = profile.load_profile(path, tmp_path)
    assert (prof.binds, prof.sbatch_extra) == ((), ())


# ----------------------------------------------------------------- the launch command
