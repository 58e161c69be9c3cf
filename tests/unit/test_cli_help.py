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


@pytest.mark.parametrize("command", [*COMMANDS, ["sweep", "values"]], ids=" ".join)
def test_an_argument_that_names_a_file_or_folder_is_labelled_a_path(command):
    """Taken as text (an empty one is refused, not read as '.'), path arguments were shown
    as `run_dir <str>` where they said `<path>`."""
    output = CliRunner().invoke(app, [*command, "--help"]).output
    lines = output.splitlines()
    arguments = lines[lines.index("Arguments:") + 1:] if "Arguments:" in lines else []
    arguments = arguments[:next((i for i, line in enumerate(arguments) if not line.strip()),
                                len(arguments))]
    labels = [line.split()[1] for line in arguments if line.startswith("  ")
              and not line.startswith("   ")]
    assert all(label == "<path>" for label in labels), output


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


def _option(path: list[str], flag: str):
    import typer

    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return next(p for p in command.params if flag in p.opts)


def test_an_option_with_choices_shows_exactly_those_its_command_accepts():
    """The metavars are written out in the CLI (it imports no benchmark or checkpoint code to
    start); each must name what the code behind it accepts, no more and no fewer."""
    from pyrecover.bench.common import MODES
    from pyrecover.bench.restart import KINDS
    from pyrecover.checkpoint.listing import CONVERT_TO
    from pyrecover.config_schema import CHECKPOINT_MODES
    from pyrecover.export import FORMATS
    from pyrecover.slurm.profile import LAUNCHERS

    accepted = {
        ("bench train", "--mode"): MODES, ("bench ckpt", "--mode"): MODES,
        ("bench restart", "--interrupt"): KINDS, ("bench restart", "--launcher"): LAUNCHERS,
        ("launch", "--mode"): CHECKPOINT_MODES, ("launch", "--launcher"): LAUNCHERS,
        ("sweep launch", "--mode"): CHECKPOINT_MODES, ("sweep launch", "--launcher"): LAUNCHERS,
        ("ckpt convert", "--to"): CONVERT_TO, ("ckpt export", "--format"): FORMATS,
    }
    for (command, flag), choices in accepted.items():
        shown = _option(command.split(), flag).metavar
        assert shown.split("|") == list(choices), (command, flag, shown)


def test_status_help_names_every_state_a_run_can_be_in():
    """A run the watchdog ended showed `state hung`, which --help did not list."""
    from pyrecover import status

    events = ["finish", "stop", "error", "crash", "hang", "no_requeue", "cancel", "start"]
    states = {status._state([{"event": kind}]) for kind in events} | {status._state([])} | {
        status._state([{"event": "health", "ok": False}])}
    shown = " ".join(CliRunner().invoke(app, ["status", "--help"],
                                        terminal_width=100).output.split())
    for state in states:
        name = state.split(" (")[0].split(":")[0]  # "stopped (...)", "ended: why"
        assert name in shown, f"state {state!r} is not in `pyrecover status --help`"



def _commands(command, words=()):
    """_commands: the words of every command under `command` (a group has `commands`)."""
    for name, sub in getattr(command, "commands", {}).items():
        yield from (_commands(sub, (*words, name)) if hasattr(sub, "commands")
                    else [(*words, name)])


def test_every_option_that_takes_a_file_or_folder_is_labelled_a_path():
    """--config read `<path>` in train and `PATH` in bench and sweep, --run-dir, --image and
    --workdir read `<str>`: one label for one kind of value, in every command."""
    import re

    import typer

    takes_a_path = {"--config", "--cluster", "--dir", "--out", "--run-dir", "--image",
                    "--workdir", "--init-cluster", "--profile-dir"}
    seen = set()
    for words in _commands(typer.main.get_command(app)):
        output = CliRunner().invoke(app, [*words, "--help"], terminal_width=200).output
        lines = output.splitlines()
        for line in lines[lines.index("Options:") + 1:]:
            option = re.match(r"  (?:-\w, )?(--[\w-]+)(?: (\S+))?", line)
            if option and option[1] in takes_a_path:
                seen.add(option[1])
                assert option[2] == "<path>", (words, line)
    assert seen >= {"--config", "--cluster", "--dir", "--run-dir", "--image", "--workdir",
                    "--init-cluster", "--out"}
