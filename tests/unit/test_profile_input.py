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


# What `scontrol show job` gave as TimeLimit for `sbatch --time=TEXT` (SLURM 22.05, the
# local cluster; tests/slurm/test_time_limits.py asks the real sbatch for some of them).
SLURM_LIMITS = [
    ("30", "00:30:00"), ("90:00", "01:30:00"), ("2:00:00", "02:00:00"), ("1-0", "1-00:00:00"),
    ("1-2", "1-02:00:00"), ("1-02:30", "1-02:30:00"), ("infinite", None), ("UNLIMITED", None),
    ("-1", None), ("0", None), ("0-0", None), ("0:00:00", None),
    # days and a dash alone are whole days
    ("1-", "1-00:00:00"), ("01-", "1-00:00:00"), ("12-", "12-00:00:00"), ("0-", None),
    # a field may overflow into the next one
    ("1-25", "2-01:00:00"), ("0:75:00", "01:15:00"), ("1-24:00:00", "2-00:00:00"),
    ("1:99:99", "02:41:00"), ("100:00:00", "4-04:00:00"), ("1-2:60", "1-03:00:00"),
    # seconds round up to whole minutes
    ("90:30", "01:31:00"), ("0:0:30", "00:01:00"), ("0:00:01", "00:01:00"),
    ("1-2:3:4", "1-02:04:00"), ("2-00:00:10", "2-00:01:00"),
    # the longest limit SLURM keeps as given
    ("35791393", "24855-03:13:00"), ("24855-03:13:08", "24855-03:14:00"),
]


def limit_seconds(shown: str) -> int:
    """The seconds of scontrol's `D-HH:MM:SS` / `HH:MM:SS`, read here without pyrecover."""
    days, _, clock = shown.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


@pytest.mark.parametrize("text, shown", SLURM_LIMITS)
def test_a_time_limit_is_the_one_slurm_gives_the_job(text, shown):
    """`--time 90:30` was taken as 5430 s, SLURM's 01:31:00 is 5460 s: launch refused
    `--time 1:30 --signal-seconds 90` although SLURM signals such a job 30 s before its end."""
    assert profile.time_seconds(text) == (None if shown is None else limit_seconds(shown))


FORMS = [  # SLURM's forms, each with the seconds it asks for
    ("{d}-{h}:{m}:{s}", lambda d, h, m, s: d * 86400 + h * 3600 + m * 60 + s),
    ("{d}-{h}:{m}", lambda d, h, m, s: d * 86400 + h * 3600 + m * 60),
    ("{d}-{h}", lambda d, h, m, s: d * 86400 + h * 3600),
    ("{d}-", lambda d, h, m, s: d * 86400),
    ("{h}:{m}:{s}", lambda d, h, m, s: h * 3600 + m * 60 + s),
    ("{m}:{s}", lambda d, h, m, s: m * 60 + s),
    ("{m}", lambda d, h, m, s: m * 60),
]


@pytest.mark.parametrize("form, asked", FORMS)
def test_any_field_values_give_whole_minutes_no_less_than_asked(form, asked):
    for d, h, m, s in ((d, h, m, s) for d in (0, 1, 3) for h in (0, 1, 23, 24, 25, 99)
                       for m in (0, 1, 59, 60, 75) for s in (0, 1, 59, 60, 61)):
        text, want = form.format(d=d, h=h, m=m, s=s), asked(d, h, m, s)
        got = profile.time_seconds(text)
        if want == 0:
            assert got is None, text
        else:
            assert got % 60 == 0 and want <= got < want + 60, (text, got)


@pytest.mark.parametrize("text", ["", "1:2:3:4", "1h", "-1-2", "1-2:3:4:5", "1.5", "1 day",
                                  "forever", "1-02:30\n", "1-2:3:", "1-:", "1-:30", "-", "1--"])
def test_time_strings_slurm_rejects_are_refused(text):
    with pytest.raises(LaunchError, match="time="):
        profile.time_seconds(text)


@pytest.mark.parametrize("text", ["35791394", "24855-03:13:09", "1-99999999", "2147483647"])
def test_a_limit_past_the_longest_slurm_keeps_is_refused(text):
    # sbatch accepts these and garbles them (TimeLimit=2957761-01:03:00, or UNLIMITED)
    with pytest.raises(LaunchError, match=f"time='{text}' is not allowed: expected at most "
                       "24855 days, or infinite"):
        profile.time_seconds(text)


@pytest.mark.parametrize("text", ["-2", "-11", "-222"])
def test_a_negative_limit_sbatch_garbles_is_refused(text):
    # sbatch takes these and gives the job TimeLimit=2982614-04:17:00 and the like
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
