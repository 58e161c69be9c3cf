"""`sweep launch` given values a user may type: what the array script says, or one line."""

from __future__ import annotations

import pytest
import yaml
from helpers import TINY, default_cluster, pyrecover
from sbatch_support import LOCAL

from pyrecover.sweep import render

GRID = {"method": "grid", "parameters": {"train.lr": {"values": [1e-3, 3e-3, 1e-2]}}}


def test_a_limit_above_the_trial_count_is_the_trial_count():
    assert render.indices(3, 10**23) == "0-2%3"
    assert render.indices(3, 2) == "0-2%2"
    assert render.indices(3, None) == "0-2"


@pytest.mark.parametrize("where", ["flag", "file"])
def test_a_huge_max_parallel_runs_every_trial_at_once_instead_of_failing_at_sbatch(
        tmp_path, where):
    """--max-parallel 99999999999999999999999 went into `#SBATCH --array=0-2%999...`, which
    the dry run showed and sbatch refuses at submit."""
    huge = 99999999999999999999999
    path = tmp_path / "lr.yaml"
    sweep = dict(GRID, max_parallel=huge) if where == "file" else GRID
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    flag = ["--max-parallel", str(huge)] if where == "flag" else []
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run", *flag,
                     "--launcher", "none", "--set", f"run.storage={tmp_path / 'st'}",
                     cwd=tmp_path, env=default_cluster(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --array=0-2%3\n" in done.stdout


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_max_parallel_below_one_is_one_line(tmp_path, value):
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump(GRID, sort_keys=False))
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
                     "--max-parallel", value, "--launcher", "none",
                     "--set", f"run.storage={tmp_path / 'st'}", cwd=tmp_path,
                     env=default_cluster(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --max-parallel={value} is not allowed: expected >= 1"]


@pytest.mark.parametrize("q", ["1e-320", "5e-324"])
def test_a_q_too_small_for_the_range_is_one_line_not_a_traceback(tmp_path, q):
    """q_uniform with q: 1e-320 was an OverflowError traceback: max / q is past float's
    range, and no multiple of such a q can be counted."""
    path = tmp_path / "q.yaml"
    path.write_text("method: random\nrun_cap: 2\nparameters:\n  train.warmup_steps: "
                    f"{{distribution: q_uniform, min: 0, max: 10, q: {q}}}\n")
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
                     "--launcher", "none", "--set", f"run.storage={tmp_path / 'st'}",
                     cwd=tmp_path, env=default_cluster(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {path}: parameters.train.warmup_steps: q={float(q)!r} is too small for "
        "min=0.0 and max=10.0 (max / q is past a float's range); give a larger q"]


def test_a_node_count_past_what_sbatch_reads_is_said_as_the_node_count(tmp_path):
    """It was said as the trials' global batch size: no world size fits 8 samples."""
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump(GRID, sort_keys=False))
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
                     "--nodes", "99999999999999999999", "--launcher", "none",
                     "--set", f"run.storage={tmp_path / 'st'}", cwd=tmp_path,
                     env=default_cluster(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: nodes=99999999999999999999 is not allowed: expected an integer 1 to "
        "2147483647 (cluster profile key nodes, option --nodes)"]


def spare_sweep(tmp_path, spares: str, *args: str):
    """`sweep launch --dry-run` on the local cluster's profile with `spare_nodes: <spares>`."""
    profile_file = tmp_path / "local.yaml"
    profile_file.write_text(LOCAL.read_text() + f"spare_nodes: {spares}\n")
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump(GRID, sort_keys=False))
    return pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
                     "--cluster", str(profile_file), "--set", f"run.storage={tmp_path / 'st'}",
                     *args, cwd=tmp_path)


def test_spare_nodes_a_sweep_drops_are_not_counted_against_its_nodes(tmp_path):
    """The profile's spare_nodes were checked as nodes + spare_nodes before the sweep dropped
    them: `spare_nodes: 2147483647` refused the sweep with `nodes + spare_nodes = 2147483649
    (--nodes, --spare-nodes)`, an option `sweep launch` does not have."""
    done = spare_sweep(tmp_path, "2147483647")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2\n" in done.stdout and "SPARES=0" in done.stdout
    assert "note: the profile's spare_nodes=2147483647 is not used by a sweep" in done.stderr


def test_a_refused_sweep_on_a_profile_with_spares_is_one_line(tmp_path):
    """The spare_nodes note came before the checks, so a refusal was two lines."""
    done = spare_sweep(tmp_path, "1", "--max-parallel", "0")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --max-parallel=0 is not allowed: expected >= 1"]


def test_a_negative_spare_nodes_in_the_profile_is_still_refused_naming_the_key(tmp_path):
    done = spare_sweep(tmp_path, "-1")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: spare_nodes=-1 is not allowed: expected an integer >= 0 (cluster profile key "
        "spare_nodes, option --spare-nodes)"]
