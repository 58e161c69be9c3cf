"""`python -m pyrecover.elastic_agent --stop-signal SIG TORCHRUN_ARGS...`: torchrun, with the
run's stop signal passed on to the workers and a clean stop reported as exit code 75.

torch's elastic agent (torchrun) handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by sending the
same signal to its workers, waiting for them, and raising SignalException; any other signal
keeps its default action, and SIGUSR2's kills the agent while the workers, which it started
in sessions of their own, never hear of it. (torch 2.9 added `--signals-to-handle`; the
image's torch is older.) So this runs torchrun's own `main` in-process with a handler that
forwards the stop signal to the agent's children, the workers, each once it is one
(`is_worker`) and catches it (one still starting would die of it: spawn.Relay): they save
and exit 75, the agent reports them failed, and `exit_code` turns that back into 75. A
worker that crashed wins over the others' 75, so the job script requeues it as a crash.

SIGTERM (preemption, `scancel`, a time limit), and a stop signal torch handles itself (INT or
HUP), take the same path from the wrapper's start (a SIGTERM before the workers started
ended the agent with 143, which the job script counts as a crash); a Ctrl-C (SIGINT) too,
once the workers started. torch's own handling forwards it too, but then SIGKILLs the
workers after a shutdown timeout, 30 s and fixed before torch 2.12, however long SLURM's
grace time is, so a stop's checkpoint of a large model was killed mid-write. Here the
workers get the signal and as long as they take to save: SLURM's KillWait or preemption
GraceTime is the bound, as it is for the srun launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from pyrecover.elastic_rdzv import bound_store_wait, rendezvous_failed
from pyrecover.preempt import EXIT_CRASH, EXIT_STOPPED, INT_AGAIN_S, parse_signal
from pyrecover.spawn import Relay


def exit_code(failures: Iterable[int]) -> int:
    """exit_code is the agent's exit code for its workers' failed exit codes, in the order
    they failed: 75 when one stopped cleanly and the others did too or were ended by the
    agent (which SIGTERMs, then SIGKILLs, the rest once one has exited); else the first
    other one, a signal's death (-N) written as the shell does (128 + N).

    The ranks agree on a stop and commit its checkpoint before any exits 75, so a 75 means
    the stop is saved whatever the agent did to the others afterwards.
    """
    codes = list(failures)
    cleanup = (-signal.SIGTERM, -signal.SIGKILL) if EXIT_STOPPED in codes else ()
    other = [c for c in codes if c != EXIT_STOPPED and c not in cleanup]
    if not codes:
        return EXIT_CRASH
    if not other:
        return EXIT_STOPPED
    return 128 - other[0] if other[0] < 0 else other[0] or EXIT_CRASH


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """children are the processes whose parent is `pid`, read from /proc."""
    found = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # comm, the 2nd field, is in parentheses and may hold spaces: split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


# Variables torch's agent puts in the environment of every worker it starts (and of no
# other process it starts).
WORKER_VARIABLES = (b"LOCAL_RANK", b"TORCHELASTIC_RUN_ID")


def _environ(pid: int | str) -> bytes | None:
    """_environ is the environment process `pid` was started with, from /proc (None where
    there is none to read): a fork that has not exec'd yet shows its parent's."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None


def is_worker(pid: int, own: bytes | None) -> bool | None:
    """is_worker tells what child `pid` of the agent, whose own environment is `own`, is:
    True once it runs a worker's command (torch's WORKER_VARIABLES are in its environment);
    None while it is still the agent's fork, before its exec (torch's start, or any helper
    the agent forks): it has the agent's handlers, and a signal sent now is lost, or kills
    it once it puts the default actions back before its exec (subprocess.Popen does); False
    where it is gone or runs something else."""
    env = _environ(pid)
    if env is None:
        return False
    if env == own:
        return None
    names = {entry.split(b"=", 1)[0] for entry in env.split(b"\0")}
    return all(name in names for name in WORKER_VARIABLES)


class WorkerRelay(Relay):
    """WorkerRelay is spawn.Relay for the children of torch's agent, which it finds in /proc
    rather than starts: a signal goes only to a child that `is_worker`, once it catches it;
    one for a child still forked waits until it is a worker, and is dropped where it runs
    something else."""

    def __init__(self, stop: int | None) -> None:
        super().__init__(stop)
        self.own = _environ("self")

    def children(self) -> tuple[list[int], list[int]]:
        """children are this process's children that are workers, and those still forks."""
        kinds = {child: is_worker(child, self.own) for child in children(os.getpid())}
        return ([c for c, kind in kinds.items() if kind],
                [c for c, kind in kinds.items() if kind is None])

    def send(self, pid: int, signum: int) -> None:
        if is_worker(pid, self.own) is not False:
            super().send(pid, signum)

    def release(self) -> None:
        for pid, signum in list(self.held):
            if is_worker(pid, self.own) is False:
                self.held.remove((pid, signum))
        super().release()

    def _takes(self, pid: int, signum: int) -> bool:
        return bool(is_worker(pid, self.own)) and super()._takes(pid, signum)


def forward_to_children(stop: int | None) -> Callable[..., None]:
    """forward_to_children is a signal handler that passes its signal on to this process's
    children, the workers, through a WorkerRelay for the run's stop signal `stop`: to each
    once it is a worker and catches it (one still forked or starting would die of it). One
    that comes before any worker exists (the agent imports torch, or waits in the
    rendezvous for the other nodes) waits for the first ones: the ranks agree on the stop,
    so those are enough. The first signal it holds back starts a thread that hands on what
    it holds, while torch's agent goes on watching the workers."""
    relay = WorkerRelay(stop)
    releasing: list[threading.Thread] = []
    waiting: list[int] = []  # signals that came before any worker; no lock: handlers append
    wake_r, wake_w = os.pipe()  # a handler's byte wakes the thread (write(2): signal-safe)
    os.set_blocking(wake_w, False)

    def forward(signum: int, _frame: object = None) -> None:
        workers, forks = relay.children()
        if not workers:
            waiting.append(signum)
        for child in workers + forks if workers else []:
            relay.send(child, signum)
        if relay.held or waiting:
            with contextlib.suppress(BlockingIOError):  # (full: the thread is woken already)
                os.write(wake_w, b"!")
            if not releasing:
                releasing.append(threading.Thread(target=_keep_releasing,
                                                  args=(relay, waiting, wake_r),
                                                  name="pyrecover-relay", daemon=True))
                releasing[0].start()

    return forward


def _keep_releasing(relay: WorkerRelay, waiting: list[int], wake: int,
                    every_s: float = 0.02) -> None:
    """_keep_releasing hands on what `relay` holds and what is `waiting` for workers. While
    some signal is, it looks every `every_s` (nothing tells when a worker starts or catches
    one); else it waits for a handler's byte on `wake`, which a signal held meanwhile left
    there, so none is missed."""
    while True:
        if relay.held or waiting:
            time.sleep(every_s)
        else:
            os.read(wake, 512)
        workers, forks = relay.children() if waiting else ([], [])
        while waiting and workers:
            signum = waiting.pop(0)
            for child in workers + forks:
                relay.send(child, signum)
        relay.release()


def keep_workers_on_sigterm(api: object, stop: int, forward: Callable[[int], None]) -> None:
    """keep_workers_on_sigterm makes torch's agent pass SIGTERM, and the run's stop signal
    `stop` where torch handles that too (INT, HUP), on to its workers and go on waiting
    for them (they save and exit 75) instead of raising, which ends in SIGKILLing them after
    its shutdown timeout. Its handler is a module-level function that every torch from 2.6
    installs by name when it starts the workers, so it is replaced there; the other signals
    keep torch's handling. A torch without it keeps its own, with a longer timeout.

    A Ctrl-C (SIGINT) goes the same way: a clean stop, as it is for a trainer, where torch
    SIGKILLed the workers mid-save after its timeout. It is always handed on: the workers
    run in sessions of their own, so a terminal's Ctrl-C reaches the agent alone, and one
    Ctrl-C is one stop. A second one, INT_AGAIN_S or more later, quits at once, as it does a
    trainer: the workers are killed (one waiting in C++ for its peers, the rendezvous, runs
    no handler) and torch's handling ends the agent (130)."""
    original = getattr(api, "_terminate_process_handler", None)
    if original is None:
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")  # torch 2.12 and later
        return
    ctrl_c: list[float] = []  # when the first SIGINT came
    own = _environ("self")

    def handler(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and ctrl_c:  # (sooner: the same Ctrl-C, twice)
            if time.monotonic() - ctrl_c[0] >= INT_AGAIN_S:
                for child in children(os.getpid()):
                    if is_worker(child, own):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(child, signal.SIGKILL)
                original(signum, frame)
        elif signum in (signal.SIGTERM, signal.SIGINT, stop):
            if signum == signal.SIGINT:
                ctrl_c.append(time.monotonic())
            forward(signum)
        else:
            original(signum, frame)

    api._terminate_process_handler = handler  # type: ignore[attr-defined]


class NoRestartAfterStop:
    """NoRestartAfterStop is a stop handler (`forward`, called with the signal) that also
    takes the restarts left from torch's agent once a stop came: under `--max-restarts N`
    the agent took the workers' clean stop (exit 75) for a failure and started them again,
    so they resumed and trained on past the stop (to a time limit that then killed them
    without a checkpoint, or past a Ctrl-C). `watch(agent_class)` finds the agent when it
    runs; a stop that came before that takes its restarts then. A stop the workers chose
    with no signal (the job's end near) is seen in their exit codes: a 75 among them takes
    the restarts too, before the agent decides on one."""

    def __init__(self, forward: Callable[..., None]) -> None:
        self.forward = forward
        self.agents: list[object] = []
        self.stopped = False

    def __call__(self, signum: int, _frame: object = None) -> None:
        self.stopped = True
        for agent in self.agents:
            agent._remaining_restarts = 0  # type: ignore[attr-defined]
        self.forward(signum)

    def watch(self, agent_class: type) -> None:
        run = agent_class.run
        watcher = self

        def recorded(agent: object, *args: object, **kwargs: object) -> object:
            watcher.agents.append(agent)
            watcher._seen_in_exit_codes(agent)
            if watcher.stopped:
                agent._remaining_restarts = 0  # type: ignore[attr-defined]
            return run(agent, *args, **kwargs)

        agent_class.run = recorded  # type: ignore[attr-defined]

    @staticmethod
    def _seen_in_exit_codes(agent: object) -> None:
        """_seen_in_exit_codes makes `agent` (its own `_monitor_workers`, which the local
        agent overrides) take its restarts once a worker exited 75."""
        monitor = agent._monitor_workers  # type: ignore[attr-defined]

        def monitored(*args: object, **kwargs: object) -> object:
            result = monitor(*args, **kwargs)
            failures = getattr(result, "failures", None) or {}
            if any(f.exitcode == EXIT_STOPPED for f in failures.values()):
                agent._remaining_restarts = 0  # type: ignore[attr-defined]
            return result

        agent._monitor_workers = monitored  # type: ignore[attr-defined]


STOPPED_CLEANLY = ("pyrecover: the workers stopped cleanly (exit 75) with a checkpoint; run the "
                   "same command again to resume")


class CleanStopLog(logging.Filter):
    """CleanStopLog holds back the ERROR line torch's agent logs when the first of its
    workers to exit exited 75, `failed (exitcode: 75) local_rank: ...`, which reads as a
    crash in a job's log. A clean stop drops it (`drop`); any other end hands it on as
    torch logged it (`release`): a worker that crashed while the others stopped is still
    torch's failure. It filters torch's logger by name, where that line has come from since
    torch 1.9, and nothing in torch changes: a torch that logs it elsewhere logs it still."""

    LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []
        logging.getLogger(self.LOGGER).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if (record.levelno >= logging.ERROR and isinstance(record.msg, str)
                and record.msg.startswith("failed (exitcode: ")
                and args and args[0] == EXIT_STOPPED):
            self.held.append(record)
            return False
        return True

    def drop(self) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)
        self.held.clear()

    def release(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeFilter(self)
        while self.held:
            logger.handle(self.held.pop(0))


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if len(args) < 2 or args[0] != "--stop-signal":
        print("usage: python -m pyrecover.elastic_agent --stop-signal SIG TORCHRUN_ARGS...",
              file=sys.stderr)
        return 2
    stop = parse_signal(args[1])
    torchrun = bound_store_wait(args[2:], os.environ)
    forward = NoRestartAfterStop(forward_to_children(stop))
    # Until torch's agent starts the workers it has no handler of its own, and its handler
    # takes SIGTERM and the stop signal here (keep_workers_on_sigterm) once it has: from the
    # start, either waits for the workers (a clean stop after their first step), where
    # SIGTERM's default action ended the agent with 143, a crash for the job script.
    for signum in {signal.SIGTERM, stop}:
        signal.signal(signum, forward)
    from torch.distributed import run  # (seconds: a stop meanwhile waits for the workers)
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    forward.watch(SimpleElasticAgent)
    keep_workers_on_sigterm(api, stop, forward)
    # torch >= 2.5 shares the agent's store with the workers, across restarts and without a
    # prefix per restart (pytorch/pytorch#135712); the workers key theirs by the restart
    # count, but over several nodes a membership change restarts a healthy node's workers
    # without counting, so the nodes' counts part and their ranks meet under different
    # keys. Each rendezvous round gets a new store instead, on worker rank 0.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    log = CleanStopLog()
    try:
        run.main(torchrun)
    except ChildFailedError as exc:
        failed = sorted(exc.failures.values(), key=lambda f: f.timestamp)
        code = exit_code(f.exitcode for f in failed)
        if code == EXIT_STOPPED:
            log.drop()
            print(STOPPED_CLEANLY, file=sys.stderr)
            return code
        log.release()
        print(f"pyrecover: workers exited with {[f.exitcode for f in failed]}: exit code "
              f"{code}", file=sys.stderr)
        return code
    except RendezvousError as exc:  # the other nodes never came: a crash, which requeues
        print(rendezvous_failed(torchrun, exc), file=sys.stderr)
        return EXIT_CRASH
    except SignalException as exc:  # the workers got the same signal and were waited for
        print(f"pyrecover: torchrun got {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        log.release()  # (none held after a clean stop: it dropped them)
    return 0


CTRL_C_BEFORE_WORKERS = ("pyrecover: torchrun stopped by Ctrl-C before its workers started "
                         "(it imported torch or waited for the other nodes); nothing to save")

if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # before torch's agent takes SIGINT: a traceback of its wait
        print(CTRL_C_BEFORE_WORKERS, file=sys.stderr)
        sys.exit(130)
