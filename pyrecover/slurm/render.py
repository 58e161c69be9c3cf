"""The job script: `job_spec(cfg, profile, python)` decides what runs, `render(spec)` writes it.

Both are pure. Rendering is deterministic: `#SBATCH` lines come from a sorted mapping, every
literal goes through `shlex.quote`, and the few words bash must expand when the job runs
(`"$SLURM_JOB_ID"`, ...) are `Shell` values, written as they are. No value from the
launching environment is ever read here, so no secret can end up in a script: secrets such
as WANDB_API_KEY reach the tasks through the environment, which sbatch exports to the job
and apptainer passes into the container.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pyrecover import container
from pyrecover.config import Config
from pyrecover.container import Bind
from pyrecover.dist import PORT_BASE, PORT_SPAN
from pyrecover.rundir import RunDir
from pyrecover.slurm import LaunchError, extra
from pyrecover.slurm.blocks import NODES_BLOCK, REQUEUE_BLOCK
from pyrecover.slurm.profile import ClusterProfile
from pyrecover.slurm.signals_block import SIGNALS_BLOCK

INDENT = "    "
SCRIPT_BLOCK = SIGNALS_BLOCK + "\n\n" + REQUEUE_BLOCK + "\n\n" + NODES_BLOCK


@dataclass(frozen=True)
class Shell:
    """A word bash expands when the job runs, e.g. `"$SLURM_JOB_ID"`; rendered as written."""

    text: str


Word = str | int | Shell


@dataclass(frozen=True)
class ArrayJob:
    """A SLURM job array: task i runs in its own run directory `<run_dir>/<prefix><i>`."""

    indices: str
    """sbatch's `--array`, e.g. `0-9%4`."""
    prefix: str = "trial-"
    setup: tuple[str, ...] = ()
    """pyrecover's arguments of a command each task runs before its first step, with its run
    directory last (a bayes trial's values). Exit 2 ends the task; another failure requeues
    it as a crash would."""


@dataclass(frozen=True)
class JobSpec:
    """Everything the script depends on; all paths absolute."""

    job_name: str
    run_dir: str
    nodes: int
    gpus_per_node: int
    cpus_per_task: int | None
    time: str
    partition: str | None
    account: str | None
    signal_seconds: int
    max_restarts: int
    launcher: str
    image: str | None
    """None: no container."""
    binds: tuple[Bind, ...]
    python: str
    """The interpreter that runs pyrecover (and torchrun) when there is no container."""
    stop_signal: str = "USR2"
    """run.stop_signal, without SIG: torchrun's agent passes it on to its workers."""
    array: ArrayJob | None = None
    """A job array (a sweep): one run directory per task under run_dir."""
    spare_nodes: int = 0
    """Nodes allocated beyond `nodes`; a step runs on `nodes` healthy ones."""
    max_restarts_in_job: int = 2
    """New steps inside the allocation (spare nodes only) before requeueing."""
    qos: str | None = None
    constraint: str | None = None
    mem: str | None = None
    """Memory per node; 0: all of it."""
    exclusive: bool = False
    sbatch_extra: tuple[str, ...] = ()
    """The profile's own `--name[=value]` sbatch options, checked (pyrecover.slurm.extra)."""

    @property
    def run(self) -> RunDir:
        return RunDir(Path(self.run_dir))


def absolute_paths(cfg: Config, cwd: str | Path) -> Config:
    """absolute_paths returns `cfg` with run.storage and data.path made absolute from `cwd`.

    The job starts in another directory, maybe on another machine, so run.yaml holds no
    relative path.
    """
    def full(path: str) -> str:
        return os.path.abspath(os.path.join(cwd, path))

    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, storage=full(cfg.run.storage)),
        data=dataclasses.replace(cfg.data, path=full(cfg.data.path)),
    )


def job_spec(cfg: Config, profile: ClusterProfile, python: str) -> JobSpec:
    """job_spec combines an experiment (paths already absolute) and a validated profile.

    run.storage is always bound into the container at the same path. Raises LaunchError for
    paths an `#SBATCH` line or an apptainer bind cannot carry.
    """
    storage = cfg.run.storage
    _check_sbatch_path("run.storage", storage)
    image = None if profile.launcher == "none" else profile.image
    if profile.launcher == "srun" and image is None:
        raise LaunchError("launcher srun runs the tasks in a container but no image is set: "
                          "set image in the cluster profile, pass --image, set "
                          "PYRECOVER_IMAGE or build ./pyrecover.sif with `make image`; or use "
                          "--launcher none")
    binds: tuple[Bind, ...] = ()
    if image is not None:
        if ":" in storage or "," in storage:
            raise LaunchError(f"run.storage={storage!r} is not allowed with a container: "
                              "apptainer's --bind cannot carry ':' or ','")
        binds = tuple(dict.fromkeys((Bind(storage, storage), *profile.binds)))
    return JobSpec(
        job_name=cfg.run.exp_name,
        run_dir=str(cfg.run_dir()),
        nodes=profile.nodes,
        gpus_per_node=profile.gpus_per_node,
        cpus_per_task=profile.cpus_per_task,
        time=profile.time,
        partition=profile.partition,
        account=profile.account,
        signal_seconds=profile.signal_seconds,
        max_restarts=profile.max_restarts,
        spare_nodes=profile.spare_nodes,
        max_restarts_in_job=profile.max_restarts_in_job,
        qos=profile.qos,
        constraint=profile.constraint,
        mem=profile.mem,
        exclusive=profile.exclusive,
        sbatch_extra=profile.sbatch_extra,
        launcher=profile.launcher,
        image=image,
        binds=binds,
        python=python,
        stop_signal=cfg.run.stop_signal.upper().removeprefix("SIG"),
    )


def outside_binds(path: str, binds: Sequence[Bind]) -> bool:
    """outside_binds tells whether `path` is not under any bind's destination."""
    return not any(Path(path).is_relative_to(b.dst or b.src) for b in binds)


def sbatch_options(spec: JobSpec) -> dict[str, str | int | None]:
    """sbatch_options maps option -> value; None is a flag without value. pyrecover's own
    options sorted by name, then the profile's sbatch_extra in its order (of two with the
    same name the later one's value, as sbatch itself takes it)."""
    log = f"{_slurm_pattern(str(spec.run.logs))}/%j.out"  # stdout and stderr, one file per job
    if spec.array is not None:  # %a: the array task's index
        log = f"{_slurm_pattern(str(Path(spec.run_dir, spec.array.prefix)))}%a/logs/%j.out"
    options: dict[str, str | int | None] = {
        "account": spec.account,
        "array": spec.array.indices if spec.array is not None else None,
        "chdir": spec.run_dir,
        "constraint": spec.constraint,
        "cpus-per-task": spec.cpus_per_task,
        "error": log,
        "exclusive": None,
        "gpus-per-node": spec.gpus_per_node,
        "job-name": spec.job_name,
        "mem": spec.mem,
        # With spares, a failed node must not end the job (SLURM's default): SLURM takes
        # it out of the allocation and the job script starts a new step on the others.
        "no-kill": None,
        "nodes": spec.nodes + spec.spare_nodes,
        "ntasks-per-node": spec.gpus_per_node,
        "open-mode": "append",  # a requeued job keeps its id: keep the earlier runs' output
        "output": log,
        "partition": spec.partition,
        "qos": spec.qos,
        "requeue": None,
        # The run's stop signal, which the trainer and the batch shell's trap wait for. 0: no
        # warning signal; the trainer still stops on its own deadline prediction.
        "signal": (f"{spec.stop_signal}@{spec.signal_seconds}" if spec.signal_seconds > 0
                   else None),
        "time": spec.time,
    }
    absent = ("account", "array", "constraint", "cpus-per-task", "mem", "partition", "qos",
              "signal")
    if spec.spare_nodes == 0:
        absent += ("no-kill",)
    if not spec.exclusive:
        absent += ("exclusive",)
    own = {k: options[k] for k in sorted(options) if not (k in absent and options[k] is None)}
    return own | dict(extra.parse(item) for item in spec.sbatch_extra)


def site_exclude(options: dict[str, str | int | None]) -> str:
    """site_exclude is the nodes the profile's sbatch_extra excludes (`--exclude=LIST`, or the
    abbreviation `--exclud`), '' for none: the job script sets the requeued job's excluded
    nodes itself (its bad nodes), which replaces the list sbatch took, so it adds these."""
    value = options.get("exclude", options.get("exclud"))
    return "" if value is None else str(value)


def step_lines(spec: JobSpec) -> list[list[Word]]:
    """step_lines is the step's command in readable pieces: srun, the container, the trainer."""
    train: list[Word] = ["train", "--config", task_path(spec, "run.yaml")]
    # The step runs on NODES of the allocation's nodes, chosen by the job script (spares
    # and known bad nodes left out), so it names its nodes and tasks itself.
    srun: list[Word] = ["srun", "--kill-on-bad-exit=1", Shell('--nodelist="$STEP_NODES"'),
                        Shell('--nodes="$NODES"')]
    # srun takes no --cpus-per-task from sbatch (SLURM 22.05 and later): without it each
    # task gets one CPU where the site binds tasks to CPUs.
    if spec.launcher not in ("torchrun", "spawn"):
        srun.append(f"--ntasks={spec.nodes * spec.gpus_per_node}")
        if spec.cpus_per_task is not None:
            srun.append(f"--cpus-per-task={spec.cpus_per_task}")
    else:
        # One task per node, which starts one worker per GPU, with the CPUs the allocation
        # holds for that node's GPUs (one each without cpus_per_task). srun would otherwise
        # take the allocation's task count (one per GPU) from the environment.
        srun += [Shell('--ntasks="$NODES"'), "--ntasks-per-node=1",
                 f"--cpus-per-task={(spec.cpus_per_task or 1) * spec.gpus_per_node}"]
    if spec.launcher == "spawn":
        # pyrecover.spawn.worker_envs: node n's workers are ranks n x gpus_per_node and up.
        train.extend(["--nproc", str(spec.gpus_per_node)])
    command: list[list[Word]]
    if spec.launcher == "torchrun":
        # torchrun itself, run by pyrecover.elastic_agent so the stop signal reaches the
        # workers as a clean stop instead of killing the agent.
        torchrun: list[Word] = ["python" if spec.image else spec.python, "-m",
                                "pyrecover.elastic_agent", "--stop-signal", spec.stop_signal]
        command = [
            [*torchrun, "--nnodes", Shell('"$NODES"'), "--nproc-per-node",
             spec.gpus_per_node],
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", Shell('"$MASTER_ADDR:$MASTER_PORT"'),
             "--rdzv-id", Shell('"$SLURM_JOB_ID"')],
            ["-m", "pyrecover", *train],
        ]
    elif spec.image:
        command = [["pyrecover", *train]]
    else:
        command = [[spec.python, "-m", "pyrecover", *train]]
    if spec.image is None:
        return [srun, *command]
    # pyrecover.container builds the whole `apptainer exec ... IMAGE COMMAND`; the part
    # before the command goes on a line of its own.
    words = [w for line in command for w in line]
    full = container.exec_argv(spec.image, words, spec.binds)  # type: ignore[arg-type]
    return [srun, full[: len(full) - len(words)], *command]


def train_argv(spec: JobSpec) -> list[Word]:
    """train_argv is the step's whole command line, as one list."""
    return [word for line in step_lines(spec) for word in line]


def render(spec: JobSpec) -> str:
    """render returns the sbatch script for `spec`."""
    options = sbatch_options(spec)
    for key, value in options.items():
        if value is not None:
            _check_sbatch_path(f"#SBATCH --{key}", str(value))
    _check_sbatch_path("the run directory", spec.run_dir)  # also in EVENTS= and the command
    sbatch = [f"#SBATCH --{k}" if v is None else f"#SBATCH --{k}={shlex.quote(str(v))}"
              for k, v in options.items()]
    step = f" \\\n{INDENT * 2}".join(_join(line) for line in step_lines(spec))
    return "\n".join([
        "#!/bin/bash",
        *(["# Rendered by `pyrecover launch`. Submitting this file again runs the same job; the",
           "# trainer resumes from the newest checkpoint in the run directory by itself."]
          if spec.array is None else
          ["# Rendered by `pyrecover sweep launch`: one array task per trial. Submitting this",
           "# file again runs the same trials; each resumes from its newest checkpoint."]),
        *sbatch,
        "",
        "set -uo pipefail",
        "",
        f"MAX_RESTARTS={spec.max_restarts}  # requeues after failures; clean stops are free",
        f"NODES={spec.nodes}  # a training step's nodes; the allocation has SPARES more",
        f"SPARES={spec.spare_nodes}",
        f"MAX_RESTARTS_IN_JOB={spec.max_restarts_in_job}",
        f"STOP_SIGNAL={shlex.quote(spec.stop_signal)}",
        f"EVENTS={_word(task_path(spec, 'events.jsonl'))}",
        f"BAD_NODES={_word(task_path(spec, 'bad-nodes'))}",
        f"SITE_EXCLUDE={shlex.quote(site_exclude(options))}  # sbatch_extra's: kept on requeues",
        f"JOB_LOG={_word(task_path(spec, 'logs'))}/\"$SLURM_JOB_ID\".out",
        "",
        SCRIPT_BLOCK if spec.array is None else _array_requeue(SCRIPT_BLOCK),
        "",
        "# The first node of each step hosts the process group's rendezvous. The port follows",
        "# from the job id and the step (pyrecover.dist.port_for_job): each job has a block of",
        "# MAX_RESTARTS_IN_JOB + 1 ports, so jobs sharing a node (a sweep's trials: neighbouring",
        "# ids) rarely collide and a new step never waits for the last one's port.",
        "IN_JOB=0",
        *_setup_lines(spec),
        "while :; do",
        f"{INDENT}start_step",
        f"{INDENT}MASTER_PORT=$(({PORT_BASE} + (SLURM_JOB_ID * (MAX_RESTARTS_IN_JOB + 1) + IN_JOB)"
        f" % {PORT_SPAN}))",
        f"{INDENT}export MASTER_PORT",
        f'{INDENT}echo "pyrecover: job $SLURM_JOB_ID (nodes $SLURM_JOB_NODELIST), step $IN_JOB '
        'on $STEP_NODES, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2',
        f"{INDENT}{step} &",
        f"{INDENT}wait_step $!  # (in the background: the stop signal's handler runs meanwhile)",
        f"{INDENT}after_step $?  # exits the job, or comes back to start another step here",
        "done",
        "",
    ])




def _setup_lines(spec: JobSpec) -> list[str]:
    if spec.array is None or not spec.array.setup:
        return []
    words: list[Word] = ["pyrecover", *spec.array.setup, task_path(spec, "")]
    argv: list[Word] = [spec.python, "-m", *words]
    if spec.image:  # no GPU needed: no --nv
        argv = container.exec_argv(spec.image, words, spec.binds, nv=False)  # type: ignore[arg-type]
    return ["", "# Once per start of the task, before its steps (sweep values: a bayes trial's",
            "# values, asked of wandb at its first start and read from run.yaml after).",
            f'{_join(argv)} || after_training "$?"', ""]


def task_path(spec: JobSpec, name: str) -> Word:
    """task_path is a file of the run directory: of this array task's own in a job array."""
    if spec.array is None:
        return str(spec.run.root / name)
    return Shell(shlex.quote(str(Path(spec.run_dir, spec.array.prefix))) +
                 f'"$SLURM_ARRAY_TASK_ID"{shlex.quote("/" + name)}')


# In a job array, the task that holds the array's own record (the last to start) has the
# array's id as its SLURM_JOB_ID, and `scontrol requeue` or `squeue -j` of that id means every
# task (seen on SLURM 22.05). An array task names itself ARRAYID_TASKID instead.
_ARRAY_TASK = '"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"'
_ARRAY_WORDS = ('squeue -h -j "$SLURM_JOB_ID"', 'squeue -h -s -j "$SLURM_JOB_ID"',
                'scontrol requeue "$SLURM_JOB_ID"',
                'scontrol update JobId="$SLURM_JOB_ID"', 'scontrol show job -o "$SLURM_JOB_ID"')


def _array_requeue(block: str) -> str:
    for words in _ARRAY_WORDS:
        if block.count(words) != 1:
            raise AssertionError(f"the script block no longer holds one {words}")
        block = block.replace(words, words.replace('"$SLURM_JOB_ID"', _ARRAY_TASK))
    return block


def _word(word: Word) -> str:
    return word.text if isinstance(word, Shell) else shlex.quote(str(word))


def _join(words: Sequence[Word]) -> str:
    """shlex.join, except that Shell words stay as written."""
    return " ".join(_word(w) for w in words)


def _slurm_pattern(path: str) -> str:
    """SLURM expands `%j` and friends in --output; a literal `%` is written `%%`."""
    return path.replace("%", "%%")


def _check_sbatch_path(key: str, path: str) -> None:
    # sbatch reads `#SBATCH` lines one line at a time and treats a backslash as an escape even
    # inside quotes, so such paths cannot be written there the way bash would read them.
    bad = next((c for c in path if c in "\\\n\r" or not c.isprintable()), None)
    if bad is not None:
        raise LaunchError(f"{key}={path!r} is not allowed: an #SBATCH line cannot carry "
                          f"{bad!r}; choose a path without it")
