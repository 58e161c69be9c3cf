"""`pyrecover bench restart --local`: the same interruptions as `bench restart`, without SLURM.

The bench plays the job script itself: it runs `pyrecover train --nproc N` on this machine,
and whenever that exits after a stop (75) or a crash it starts it again at once, with no
queue in between. What is timed is what a requeue or a restart inside the allocation costs
beyond SLURM's own part (its requeue delay, srun and the job script): the stop, the exit,
Python and torch starting again, the process group, the restore and the first step.

It exists to attribute the `rest` of `bench restart` on a machine that has no SLURM, e.g. a
16-core GPU machine where the 2-core development VM's figures may be core-bound
(`make gpu-check` runs it with `train.device=cpu` at world sizes 2 and 4, and on the GPU).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from pyrecover.bench import restart
from pyrecover.bench.common import (
    BenchError,
    Note,
    at_least,
    machine,
    make_dir,
    num,
    quiet,
    trainer_env,
)
from pyrecover.phases import attempts
from pyrecover.rundir import RunDir
from pyrecover.spawn import exit_status

CONFIG_ERROR = 2  # a config or data error: starting again cannot help


class Supervisor:
    """Supervisor is the job script without SLURM: it starts the trainer (`argv`, in a session
    of its own) and starts it again at once whenever it exits with anything but 0 or 2, until
    `stop`. Every exit code is kept in `codes`; the output goes to `log`."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv, self.env, self.log = argv, env, log
        self.codes: list[int] = []
        self.proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bench-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with open(self.log, "ab") as out:
            while True:
                proc = self._launch(out)
                if proc is None:
                    return
                code = exit_status(proc.wait())
                self.codes.append(code)
                out.write(f"bench: the trainer exited with {code}\n".encode())
                out.flush()
                if code in (0, CONFIG_ERROR):
                    return

    def _launch(self, out: IO[bytes]) -> subprocess.Popen | None:
        with self._lock:
            if self._stopping.is_set():
                return None
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            return self.proc

    def ended(self) -> str | None:
        """ended says why the trainer is no longer restarted, once that happened on its own."""
        if self._thread.is_alive() or self._stopping.is_set() or not self._thread.ident:
            return None
        said = [line for line in self.log.read_text(errors="replace").splitlines()
                if line.startswith("error: ")]
        return (f"the trainer exited with {self.codes[-1] if self.codes else '?'}"
                + (f" ({said[-1]})" if said else ""))

    def send(self, signum: int) -> None:
        """send signals the running trainer (its launcher forwards to every worker)."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signum)

    def stop(self, grace_s: float = 60.0) -> None:
        """stop ends the trainer for good: SIGTERM (it saves and exits), then SIGKILL to its
        whole session after `grace_s`."""
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._thread.join(grace_s)


def train_argv(name: str, storage: Path, config: Path | None, sets: Sequence[str],
               nproc: int) -> list[str]:
    """train_argv is the trainer's command: it trains until stopped and logs every step."""
    argv = [sys.executable, "-m", "pyrecover", "train", "--nproc", str(nproc)]
    argv += ["--config", str(config)] if config is not None else []
    for item in [*sets, f"run.storage={storage}", f"run.exp_name={name}",
                 "train.max_steps=1000000", "train.log_interval=1", "tracking.wandb=disabled"]:
        argv += ["--set", item]
    return argv


def bench_restart_local(storage: Path, config: Path | None, sets: Sequence[str], nproc: int,
                        kinds: Sequence[str], repeat: int, state_gb: float | None,
                        timeout: float = 600.0, note: Note = quiet) -> dict[str, Any]:
    """bench_restart_local runs the benchmark (see the module) and returns a report shaped
    like `bench_restart`'s, with no requeue delay."""
    restart.check_args(kinds, repeat, state_gb, timeout)
    at_least(1, nproc=nproc)
    from pyrecover import batch, datasource
    from pyrecover import config as config_mod

    sets = [*(restart.model_for_state(state_gb) if state_gb else []), *sets]
    try:  # a bad config or corpus is one line here, before any process starts
        cfg = config_mod.load(config, list(sets))
        batch.resolve(cfg, nproc)  # a global batch that does not split over the world size
        datasource.check_source(cfg.data.path, cfg.data.column)
    except (config_mod.ConfigError, datasource.DataError) as exc:
        raise BenchError(str(exc)) from None
    storage = storage.resolve()
    make_dir(storage)
    name = f"bench-restart-{uuid.uuid4().hex[:8]}"
    run = RunDir(storage / name)
    run.logs.mkdir(parents=True, exist_ok=True)
    env = trainer_env(("SLURM_", "PYRECOVER_"))
    env.update({"PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled",
                "PYRECOVER_KILL_ON_FILE": str(run.root / restart.KILL_FILE),
                "PYRECOVER_KILL_RANK": "last", "PYRECOVER_KILL_TARGET": "self"})
    log = run.logs / "bench-local.out"
    trainer = Supervisor(train_argv(name, storage, config, sets, nproc), env, log)
    note(f"{nproc} local process(es), run directory {run.root}, output {log}")
    trainer.start()
    try:
        cycles = restart.run_cycles(LocalWaiter(trainer, run, timeout), interrupt, kinds,
                                    repeat, note)
    finally:
        trainer.stop()
    return {"job": None, "launcher": "local", "nproc": nproc, "exit_codes": trainer.codes,
            **restart.results(run, cycles, state_gb), "machine": machine(storage)}


class LocalWaiter:
    """LocalWaiter polls the run's events until a condition holds, the trainer stops being
    restarted (it finished or failed on bad input), or the timeout passes."""

    def __init__(self, trainer: Supervisor, run: RunDir, timeout: float) -> None:
        self.trainer, self.run, self.timeout = trainer, run, timeout

    def until(self, check, what: str) -> Any:
        deadline = time.monotonic() + self.timeout
        while not (result := check()):
            if (why := self.trainer.ended()) is not None:
                raise BenchError(f"{why} while waiting for {what}; see "
                                 f"{self.trainer.log}")
            if time.monotonic() > deadline:
                raise BenchError(f"no {what} after {self.timeout:.0f}s; see {self.trainer.log}")
            time.sleep(restart.POLL_S)
        return result


def interrupt(waiter: LocalWaiter, kind: str, index: int) -> dict[str, Any]:
    """interrupt ends attempt `index` the `kind` way (SIGUSR2 to the trainer, or the kill
    file) and measures until the first step of the next attempt that gets that far."""
    run = waiter.run
    sent = time.time()
    if kind == "signal":
        waiter.trainer.send(signal.SIGUSR2)
    else:
        (run.root / restart.KILL_FILE).write_text(f"{sent}\n")
    resumed, step = waiter.until(lambda: restart.stepping(run, index + 1),
                                 "the first resumed step")
    seen = time.time()
    runs = attempts(run.read_events())
    return restart.cycle(kind, sent, seen, step, runs[index] + runs[resumed],
                         resumed - index - 1, resumed, delay=0.0)


def format_local(report: dict[str, Any]) -> str:
    """format_local is `bench restart`'s table for a local run: SLURM's part is not in it."""
    size = report["state_bytes"]
    m = report["machine"]
    head = (f"bench restart --local: {report['nproc']} local process(es), world size "
            f"{report['world_size']}, checkpoint {num(size / 1e9 if size else None, 3)} GB; "
            f"{m.get('cpus')} CPUs ({m.get('cpu', '?')}), load {m.get('load_avg_1m')}; seconds; "
            "no SLURM: no requeue delay, srun or job script")
    return head + "\n" + restart.format_restart(report).split("\n", 1)[1]
