"""The cluster profile's site options (qos, constraint, mem, exclusive) and its escape hatch
sbatch_extra: each is its own `#SBATCH` line that bash and sbatch read back literally, the
command line overrides or adds to the profile, and an option pyrecover sets itself cannot be
set twice. Bad values are one line with exit 2 (test_launch_input.py's tables)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from helpers import TINY, default_cluster, pyrecover
from sbatch_support import (
    EXAMPLE,
    HOSTILE,
    bash_words,
    check_golden,
    run_step,
    sbatch_lines,
    shellcheck,
    spec_for,
)
from typer.testing import CliRunner

from pyrecover.cli import app
from pyrecover.slurm import LaunchError, extra, profile, render, sinfo
from pyrecover.slurm.render import ArrayJob

EXTRA = ("--gres-flags=enforce-binding", f"--comment=it's {HOSTILE}", "--hold")
SITE = {"qos": "high.prio", "constraint": "[rack1|rack2]&a100*2", "mem": "0",
        "exclusive": True, "sbatch_extra": EXTRA}


def test_each_site_key_is_its_sbatch_line_and_reads_back_literally(tmp_path):
    spec = spec_for("srun", **SITE)
    script = render.render(spec)
    lines = sbatch_lines(script)
    options = render.sbatch_options(spec)
    assert len(lines) == len(options)
    for line, (key, value) in zip(lines, options.items(), strict=True):
        assert bash_words(line) == [f"--{key}" if value is None else f"--{key}={value}"]
    words = [bash_words(line)[0] for line in lines]
    assert {"--qos=high.prio", "--constraint=[rack1|rack2]&a100*2", "--mem=0",
            "--exclusive"} <= set(words)
    # pyrecover's own options sorted, then the profile's extras as written, in its order
    assert words[-3:] == list(EXTRA) and words[:-3] == sorted(words[:-3])
    argv, stderr, code = run_step(script, tmp_path)
    assert code == 0 and argv, stderr
    assert not list(tmp_path.rglob("pwned"))


def test_shellcheck_accepts_a_script_with_every_site_key_set(tmp_path):
    shellcheck(render.render(spec_for("srun", **SITE)), tmp_path, "SC2016")


def test_unset_site_keys_leave_the_script_as_before():
    check_golden("srun.sbatch", render.render(spec_for("srun", exclusive=False)))
    keys = {line.split("=")[0] for line in sbatch_lines(render.render(spec_for("srun")))}
    assert not {"--qos", "--constraint", "--mem", "--exclusive"} & keys


@pytest.mark.parametrize("key, good", [
    ("qos", ["normal", "gpu-high", "a.b_c"]),
    ("constraint", ["a100", "a100&ib", "[rack1|rack2]", "gpu80gb*2", "(a|b)&c", "x:2,y"]),
    ("mem", ["0", "1024", "64G", "64g", "512m", "2T", "100k"]),
])
def test_site_values_slurm_takes_are_accepted(key, good):
    for value in good:
        profile.validate(profile.ClusterProfile(**{key: value}))


@pytest.mark.parametrize("key, value", [
    ("qos", ""), ("qos", "a b"), ("qos", "$(id)"), ("constraint", ""), ("constraint", "a b"),
    ("constraint", "a\nb"), ("constraint", "a;b"), ("constraint", "'a'"), ("mem", ""),
    ("mem", "64GB"), ("mem", "1.5G"), ("mem", "G"), ("mem", "64 G"), ("mem", "64G\n"),
])
def test_site_values_slurm_would_misread_are_refused(key, value):
    with pytest.raises(LaunchError, match=f"^{key}=.* is not allowed: expected .*"
                                          f"\\(cluster profile key {key}, option --{key}\\)$"):
        profile.validate(profile.ClusterProfile(**{key: value}))


@pytest.mark.parametrize("text, value", [
    ("true", True), ("Yes", True), ("ON", True), ("1", True), ("false", False), ("no", False),
    ("Off", False), ("0", False),
])
def test_exclusive_reads_yaml_booleans(tmp_path, text, value):
    path = tmp_path / "p.yaml"
    path.write_text(f"exclusive: {text}\n")
    assert profile.load_profile(path, tmp_path).exclusive is value


def test_sbatch_extra_is_a_list_or_one_string(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("sbatch_extra:\n  - --reservation=big\n  - --gres-flags=enforce-binding\n")
    assert profile.load_profile(path, tmp_path).sbatch_extra == (
        "--reservation=big", "--gres-flags=enforce-binding")
    path.write_text("sbatch_extra: --hold\n")
    assert profile.load_profile(path, tmp_path).sbatch_extra == ("--hold",)


def every_option_spec():
    spec = spec_for("srun", spare_nodes=1, **{**SITE, "sbatch_extra": ()})
    return dataclasses.replace(spec, array=ArrayJob("0-3"))


@pytest.mark.parametrize("key", sorted(render.sbatch_options(every_option_spec())))
def test_no_option_pyrecover_sets_can_be_set_again_through_sbatch_extra(key):
    for item in (f"--{key}", f"--{key}=1"):
        with pytest.raises(LaunchError, match=f"^sbatch_extra '{re.escape(item)}' is not "
                                              f"allowed: pyrecover sets --{key} itself \\("):
            extra.check(item)


@pytest.mark.parametrize("item, owner", [
    ("--tim=5", "time"),  # sbatch's getopt_long takes an unambiguous abbreviation
    ("--part=debug", "partition"),
    ("--tasks-per-node=2", "ntasks-per-node"),
    ("--no-requeue", "requeue"),
    ("--workdir=/tmp", "chdir"),
])
def test_other_spellings_of_pyrecovers_options_are_refused_too(item, owner):
    with pytest.raises(LaunchError, match=f"would change --{owner}, which pyrecover sets"):
        extra.check(item)


@pytest.mark.parametrize("item", ["--reservation=big", "--gres-flags=enforce-binding",
                                  "--hold", "--gpus=8", "--ntasks=8", "--mem-per-cpu=4G",
                                  "--exclude=node[1-3]", "--comment=two words", "--x="])
def test_site_options_pyrecover_does_not_set_are_written_as_given(item):
    extra.check(item)
    spec = spec_for("none", sbatch_extra=(item,))
    assert bash_words(sbatch_lines(render.render(spec))[-1]) == [item]


def test_command_line_options_override_the_profiles_site_keys(tmp_path):
    cluster = tmp_path / "site.yaml"
    cluster.write_text("qos: low\nmem: 10G\nexclusive: yes\nconstraint: a100\n"
                       "sbatch_extra: [--reservation=big]\n")
    common = ["--cluster", str(cluster), "--config", str(TINY), "--launcher", "none",
              "--qos", "high", "--no-exclusive", "--sbatch-extra", "--comment=x y",
              "--set", f"run.storage={tmp_path / 'st'}", "--dry-run"]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"method": "grid",
                                     "parameters": {"train.lr": {"values": [0.1]}}}))
    for command in (["launch"], ["sweep", "launch", str(sweep)]):
        done = pyrecover(*command, *common, cwd=tmp_path, env=default_cluster(tmp_path))
        assert done.returncode == 0, done.stderr
        words = [bash_words(line)[0] for line in sbatch_lines(done.stdout)]
        assert {"--qos=high", "--mem=10G", "--constraint=a100"} <= set(words)
        assert "--exclusive" not in words and "--qos=low" not in words
        assert words[-2:] == ["--reservation=big", "--comment=x y"]
        assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("command", [["launch"], ["sweep", "launch"]])
def test_launch_help_lists_the_site_options(command):
    result = CliRunner().invoke(app, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for option in ("--qos", "--constraint", "--mem", "--exclusive / --no-exclusive",
                   "--sbatch-extra"):
        assert option in result.output


def uncommented(text: str, keys: tuple[str, ...]) -> str:
    """The profile text with the commented-out examples of `keys` (and their list items)
    made real."""
    out, in_list = [], False
    for line in text.splitlines():
        body = line.removeprefix("# ")
        starts = body.split(":")[0] in keys
        in_list = starts or (in_list and body.lstrip().startswith("- "))
        out.append(body.split("  #")[0].split(" # ")[0] if starts or in_list else line)
    return "\n".join(out) + "\n"


SITE_KEYS = ("qos", "constraint", "mem", "exclusive", "sbatch_extra")


@pytest.mark.parametrize("source", ["init-cluster", "example"])
def test_the_commented_site_examples_work_once_uncommented(tmp_path, source):
    text = sinfo.starting_profile(None) if source == "init-cluster" else EXAMPLE.read_text()
    for key in SITE_KEYS:
        assert f"# {key}:" in text
    path = tmp_path / "p.yaml"
    path.write_text(uncommented(text, SITE_KEYS))
    prof = profile.load_profile(path, tmp_path)
    profile.validate(prof)
    assert prof.qos and prof.constraint == "a100&ib" and prof.mem == "0" and prof.exclusive
    assert "--reservation=big" in prof.sbatch_extra


@pytest.mark.parametrize("key", ["nodes", "gpus_per_node", "cpus_per_task", "max_restarts",
                                 "spare_nodes", "max_restarts_in_job"])
def test_a_count_past_what_sbatch_and_bash_read_is_refused_before_the_submit(key):
    """--cpus-per-task 99999999999999999999 passed --dry-run into '#SBATCH
    --cpus-per-task=99999999999999999999', which sbatch refuses at submit ('Numeric argument
    to big'); a max_restarts that big made the job script's `[ -ge ]` an error at every
    failure. Each count is an int for sbatch, and bash, too."""
    low = 0 if "restarts" in key or key == "spare_nodes" else 1
    alone = dataclasses.replace(profile.ClusterProfile(), nodes=1, gpus_per_node=1)
    # (with the other counts at 1, or 0: their sum and product are counts too, below)
    profile.validate(dataclasses.replace(alone, **{key: 2**31 - 1 - (key == "spare_nodes")}))
    with pytest.raises(LaunchError) as caught:
        profile.validate(dataclasses.replace(profile.ClusterProfile(), **{key: 2**31}))
    assert str(caught.value).startswith(f"{key}=2147483648 is not allowed: expected an "
                                        f"integer {low} to 2147483647 (cluster profile key")


def test_a_huge_cpus_per_task_is_one_line_at_dry_run(tmp_path):
    done = pyrecover("launch", "--config", str(TINY), "--dry-run", "--launcher", "none",
                     "--cpus-per-task", "99999999999999999999",
                     "--set", f"run.storage={tmp_path / 'st'}", cwd=tmp_path,
                     env=default_cluster(tmp_path))
    assert done.returncode == 2, done.stdout
    assert done.stderr.strip().splitlines() == [
        "error: cpus_per_task=99999999999999999999 is not allowed: expected an integer 1 to "
        "2147483647 (cluster profile key cpus_per_task, option --cpus-per-task)"]


@pytest.mark.parametrize("counts, said", [
    ({"nodes": 2**31 - 1, "spare_nodes": 1},
     "nodes + spare_nodes = 2147483648 (--nodes, --spare-nodes)"),
    ({"nodes": 2**30, "gpus_per_node": 2},
     "nodes x gpus_per_node = 2147483648 (--nodes, --gpus-per-node)"),
])
def test_counts_that_add_up_past_what_sbatch_and_srun_read_are_refused(counts, said):
    """Each count alone passed, and `--nodes 2147483647 --spare-nodes 1` rendered
    '#SBATCH --nodes=2147483648' at --dry-run, which sbatch refuses at submit (and the tasks
    of nodes x gpus_per_node, srun's --ntasks)."""
    with pytest.raises(LaunchError) as caught:
        profile.validate(dataclasses.replace(profile.ClusterProfile(), **counts))
    assert str(caught.value) == f"{said} is not allowed: expected at most 2147483647"
