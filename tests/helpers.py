"""Small helpers the tests share: a real corpus and a real `pyrecover` subprocess."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from pyrecover import datasource
from pyrecover.rundir import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "launch" / "experiments" / "tiny.yaml"


def build_corpus(out: Path, max_bytes: int = 400_000) -> Path:
    """build_corpus writes a parquet of real text: the start of Python's own stdlib sources."""
    datasource.prepare(sysconfig.get_paths()["stdlib"], out, (".py",), max_bytes=max_bytes)
    return out


def files_under(path: Path) -> list[Path]:
    """files_under is every file and folder below `path`, relative to it: what a refused
    command must leave as it was."""
    return sorted(p.relative_to(path) for p in path.rglob("*"))


def pyrecover(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
              timeout: float = 300, max_file_bytes: int | None = None,
              via: tuple[str, ...] = ("-m", "pyrecover"),
              file_permissions: bool = False) -> subprocess.CompletedProcess:
    """pyrecover runs the CLI in a fresh interpreter, in its own session (process group).

    `max_file_bytes` caps the size of any file it writes (RLIMIT_FSIZE): a write past it fails
    with EFBIG, as on a full disk (Python ignores SIGXFSZ). `via` is what the interpreter runs
    before `args` (a script of a test's own that runs the CLI: `("-c", CODE, ...)`). With
    `file_permissions`, root's power to ignore them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)
    is dropped for the command: a chmod 000 file is then as unreadable to it as to a
    colleague reading someone else's run.
    """
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYRECOVER_")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID",
              "SLURM_PROCID", "SLURM_STEP_ID"):
        full_env.pop(k, None)
    full_env["WANDB_MODE"] = "disabled"  # no test talks to wandb unless it asks to
    full_env.update(env or {})

    def limit() -> None:
        if max_file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
        if file_permissions and os.geteuid() == 0:
            drop_file_capabilities()

    return subprocess.run([sys.executable, *via, *args], env=full_env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          start_new_session=True, preexec_fn=limit)


def drop_file_capabilities() -> None:
    """drop_file_capabilities takes CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH out of this
    process's bounding set (prctl PR_CAPBSET_DROP), so that a program it then execs as root
    is held to file permissions."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (linux/capability.h)
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def default_cluster(tmp_path: Path) -> dict[str, str]:
    """default_cluster is the environment that names an empty cluster profile (the built-in
    defaults: 1 node, 4 GPUs, srun) beside tmp_path, for `launch` and `sweep launch`, which
    need one."""
    defaults = tmp_path.parent / f"{tmp_path.name}-defaults-cluster.yaml"
    defaults.write_text("")
    return {"PYRECOVER_CLUSTER": str(defaults)}


def tiny_args(storage: Path, corpus: Path, name: str, *extra: str) -> list[str]:
    """tiny_args is `--config tiny.yaml` pointed at a storage folder and corpus."""
    args = ["--config", str(TINY), "--set", f"run.storage={storage}",
            "--set", f"data.path={corpus}", "--set", f"run.exp_name={name}"]
    for item in extra:
        args += ["--set", item]
    return args


def load_export(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def is_running(pid: int) -> bool:
    """True unless the process is gone or a zombie (this machine's PID 1 reaps late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def events(run_dir: Path, kind: str) -> list[dict]:
    """events are the run's `events.jsonl` records of one kind, in order."""
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == kind]


def check_restart_cycles(report: dict) -> None:
    """check_restart_cycles asserts that a `bench restart` report of one signal and one crash
    adds up: each cycle's phases come in order (a resume restores, so every start phase is
    there; rank 0 survives the kill), span the interruption to the resumed step, and the
    bench's own clock, which saw that step in the events it polls, agrees: never less, more
    only by its polling and a busy machine's scheduling."""
    from pyrecover.phases import START_PHASES, STOP_PHASES

    assert [c["kind"] for c in report["cycles"]] == ["signal", "crash"], report["cycles"]
    expected = {"signal": ["signal_sent", *STOP_PHASES, *START_PHASES],
                "crash": ["crash_sent", "exit", *START_PHASES]}
    for cycle in report["cycles"]:
        rows = cycle["rows"]
        assert [r["phase"] for r in rows] == expected[cycle["kind"]], rows
        assert all(r["gap"] >= 0 for r in rows), rows
        assert abs(sum(r["gap"] for r in rows) - cycle["total_s"]) < 0.01, cycle
        assert cycle["observed_s"] >= cycle["total_s"], cycle  # never less; more by polling
        # The choice says where its seconds went: building the model and the optimizer, then
        # waiting for the checksum pass begun beside them; both inside the phase's gap.
        chosen = next(r for r in rows if r["phase"] == "checkpoint_chosen")
        assert {"built_s", "verify_s", "wait_s"} <= chosen.keys(), chosen
        assert 0 <= chosen["built_s"] + chosen["wait_s"] <= chosen["gap"] + 0.01, chosen
        assert chosen["verify_s"] >= 0, chosen


def saved_and_restored(root: Path, mode: str, src, dst):
    """saved_and_restored commits `src`'s parts (bench State) at step 2 in `mode` under a run
    directory in `root` with one rank, restores that checkpoint into `dst`'s parts and
    returns it (the store's verified Checkpoint)."""
    from pyrecover.checkpoint import CheckpointManager, store
    from pyrecover.rundir import RunDir

    run = RunDir(root / "run")
    run.create()
    cpu = torch.device("cpu")
    saver = CheckpointManager(run, mode, 2, 2, 0, 1, src.parts, cpu, False)
    saver.at_step(2)
    saver.finish(2)
    ckpt = store.verify(run.checkpoints / "step-2")
    CheckpointManager(run, mode, 2, 2, 0, 1, dst.parts, cpu, False).restore(ckpt)
    return ckpt


def _gloo_rank(rank: int, world_size: int, port: int, errors, scenario, args,
               group: bool) -> None:
    import traceback
    from datetime import timedelta

    import torch.distributed as tdist

    from pyrecover import dist

    try:
        if group:
            tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                     world_size=world_size, timeout=timedelta(seconds=60))
            scenario(rank, *args)
        else:
            scenario(rank, port, *args)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.teardown()


def run_ranks(scenario, *args, world_size: int = 2, timeout: float = 300,
              group: bool = True) -> None:
    """run_ranks runs `scenario(rank, *args)` in `world_size` spawned processes joined in one
    gloo process group, and fails with every rank's traceback, or the exit codes, unless each
    returned. `scenario` must be a module-level function (the processes import it). With
    `group=False` no group is joined for it: it runs as `scenario(rank, port, *args)`."""
    import torch.multiprocessing as mp

    from pyrecover import spawn

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = spawn.free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world_size, port, errors, scenario, args,
                                                   group))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert [p.exitcode for p in procs] == [0] * world_size


def starting_worker(stop: str) -> str:
    """starting_worker is a Python script (argv[1]: a folder) standing for a trainer still in
    start-up: it catches SIGTERM from its first moment (touching `term`), says `ready`, and
    catches the run's stop signal `stop` (e.g. "SIGUSR2"; exit 75) only once `go` exists."""
    return f"""
import os, signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (folder / "term").touch())
(folder / "ready").touch()
while not (folder / "go").exists():
    time.sleep(0.01)
signal.signal(signal.{stop}, lambda *_: os._exit(75))
while True:
    time.sleep(0.01)
"""


@contextlib.contextmanager
def started(argv: list[str], **kwargs):
    """started runs `argv` in a session of its own, its output in pipes (text), and yields
    it; one still running at the end is killed with its group."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
