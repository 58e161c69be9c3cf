"""`--help` teaches: every command a user runs by hand says what it does and shows how, with
examples that name the command itself, so a copied line runs that command."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pyrecover.cli import app

COMMANDS = [["train"], ["launch"], ["status"], ["cancel"], ["plot"], ["data", "prepare"],
            ["ckpt", "ls"], ["ckpt", "verify"], ["ckpt", "export"], ["ckpt", "convert"],
            ["sweep", "launch"], ["sweep", "status"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_of_each_command_shows_examples_of_that_command(command):
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "  Examples:" in lines, result.output
    examples = lines[lines.index("  Examples:") + 1:]
    examples = examples[:next(i for i, line in enumerate(examples) if not line.strip())]
    starts = [line.strip() for line in examples if not line.startswith("      ")]
    assert starts and all(s.startswith("pyrecover " + " ".join(command) + " ")
                          for s in starts), examples


def test_the_help_of_options_matches_what_they_do():
    verify = CliRunner().invoke(app, ["ckpt", "verify", "--help"]).output
    assert "default: every checkpoint" in verify and "newest valid" not in verify
    sweep = CliRunner().invoke(app, ["sweep", "launch", "--help"]).output
    assert "spawn" in sweep.split("--launcher", 1)[1].split("--max-restarts", 1)[0]


def test_gpu_check_help_names_every_step_it_has():
    """The --only help lists the steps by hand (the CLI does not import the bench to start):
    a step added to gpu_check.STEPS must be named there too."""
    import re

    from pyrecover.bench.gpu_check import STEPS

    text = " ".join(CliRunner().invoke(app, ["bench", "gpu-check", "--help"],
                                       terminal_width=200).output.split())
    listed = text.split("--only", 1)[1].split("The report keeps", 1)[0]
    names = set(re.findall(r"[a-z0-9-]+", listed))
    assert [s for s in STEPS if s not in names] == []


@pytest.mark.parametrize("group", [[], ["ckpt"], ["bench"], ["sweep"], ["data"], ["image"]],
                         ids=lambda g: " ".join(["pyrecover", *g]))
def test_every_command_listed_in_a_help_says_what_it_does_whole(group):
    """typer cut each command's docstring at the width ('Train, resuming from the newest
    valid checkpoint in the run...'); each has a short_help that fits."""
    result = CliRunner().invoke(app, [*group, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    listed = result.output.split("Commands:", 1)[1].strip().splitlines()
    assert listed and all(line.rstrip().endswith(".") and not line.endswith("...")
                          for line in listed), listed
