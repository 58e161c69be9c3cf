"""Local workers: `pyrecover train --nproc N` starts N trainer processes here, alone or as one
`srun` task per node, and waits for them (the process group itself is dist.py's).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pyrecover import preempt
from pyrecover.dist import PORT_BASE, PORT_SPAN, SPAWNED, DistEnv, DistError

# Where free_port looks first: below the kernel's ephemeral range, whose ports every outgoing
# connection (gloo's own sockets among them) takes from, so none is handed out by accident
# between free_port and the rendezvous binding it; and above the job scripts' rendezvous ports
# (dist.port_for_job), so a local run on a node does not take a SLURM job's port.
_PORTS_FROM = PORT_BASE + PORT_SPAN
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(tries: int = 50) -> int:
    """free_port is a TCP port nobody listens on right now, outside the ephemeral range where
    the system has one, for a rendezvous that binds it a moment later."""
    try:
        low = int(_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(tries if low > _PORTS_FROM + 1000 else 0):
        port = random.randrange(_PORTS_FROM, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the kernel's choice, in the ephemeral range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_envs(parent: DistEnv, nproc: int) -> list[dict[str, str]]:
    """worker_envs are the torchrun-style variables of the `nproc` workers that process
    `parent` starts: alone (`single`), or as one `srun` task per node (`slurm`), where
    worker i of node n is rank n x nproc + i and node 0's address hosts the rendezvous."""
    if parent.launcher == "slurm" and parent.local_world_size != 1:
        raise DistError(f"--nproc {nproc} under srun needs one task per node (srun "
                        f"--ntasks-per-node=1), but this node runs {parent.local_world_size}")
    if parent.launcher not in ("single", "slurm"):
        raise DistError(f"--nproc {nproc}: this process is already a worker of {parent.launcher}")
    nodes = parent.world_size
    return [{"RANK": str(parent.node_rank * nproc + i), "WORLD_SIZE": str(nodes * nproc),
             "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": str(nproc),
             "GROUP_RANK": str(parent.node_rank), "MASTER_ADDR": parent.master_addr,
             "MASTER_PORT": str(parent.master_port), SPAWNED: "1"} for i in range(nproc)]


def exit_status(code: int) -> int:
    """exit_status is a child's return code as a shell shows it: a signal's death -N is 128+N."""
    return 128 - code if code < 0 else code


STOPPED_FOR_S = 2.0  # workers stopped this long are not waited for (spawn_local)
QUIT_GRACE_S = 1.0  # to quit on a Ctrl-C; one waiting in C++ runs no handler: killed then
LAUNCHER_ENV = "PYRECOVER_LAUNCHER_PID"  # a spawn_local worker's launcher (follow_launcher)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def follow_launcher(environ: Mapping[str, str]) -> None:
    """follow_launcher has a worker of spawn_local sent SIGTERM when its launcher dies (a
    kill -9 of `train --nproc N`, the OOM killer): it then stops as on a preemption, saving
    a checkpoint, where before it trained on alone, holding the run's lock. Linux only."""
    pid = environ.get(LAUNCHER_ENV, "")
    if not pid.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM),
                                                   0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != int(pid):  # gone before the prctl: the signal would never come
        os.kill(os.getpid(), signal.SIGTERM)


def spawn_local(argv: Sequence[str], nproc: int, environ: Mapping[str, str],
                grace_s: float = 60.0, parent: DistEnv | None = None,
                killed: Callable[[int, str], None] | None = None,
                stop: int | None = None) -> int:
    """spawn_local runs `argv` as `nproc` workers of this process (`parent`, default: alone
    on this machine) with torchrun-style variables from `worker_envs`. It hands FORWARDED
    and the run's stop signal `stop` (HUP, XCPU: run.stop_signal) on to them.

    Waits for all of them. When one fails, the others get `grace_s` seconds to notice (their
    next collective fails) and exit by themselves, which lets memory mode persist what the
    survivors hold; then they are terminated (then killed). None after a Ctrl-C while they
    start: those it quit leave the others waiting for a group that never forms (in C++, no
    handler runs: killed after QUIT_GRACE_S); a second Ctrl-C ends them all so. The exit
    code of what caused it (`cause`) is returned (128+N for a death by signal N), so the
    caller exits like the job did. `killed(rank, how)` is told, once all have ended, of each
    worker a signal from outside killed (SIGKILL: the OOM killer; SIGSEGV, ...): its peers
    only saw it vanish.
    """
    if parent is None:
        parent = DistEnv("single", 0, 1, 0, 1, 0, "127.0.0.1", free_port())
    workers = worker_envs(parent, nproc)
    procs: list[subprocess.Popen] = []

    deaths: list[tuple[int, str]] = []  # (rank, how) of those a signal from outside killed

    def name(i: int, p: subprocess.Popen) -> None:
        rank = parent.node_rank * nproc + i
        # a rank that found a peer gone only says so; one a Ctrl-C quit (130) is the Ctrl-C
        if p.returncode not in NO_CAUSE and not (said_ctrl_c and p.returncode in CTRL_C_CODES):
            print(f"pyrecover: rank {rank} (pid {p.pid}) {ended(p.returncode)}",
                  file=sys.stderr, flush=True)
        if p.returncode < 0 and -p.returncode not in forwarded:  # not a stop handed on
            deaths.append((rank, ended(p.returncode)))

    said_ctrl_c: list[float] = []  # when the first Ctrl-C came
    quitting: list[bool] = []  # a Ctrl-C while they start: no worker has anything to save
    quit_now: list[bool] = []  # a second Ctrl-C: quit at once, as each trainer does
    # (signal, how many workers had started) of each handed on while they start: one that
    # came before a worker's start (before the first's: before any) goes to it once started.
    reached: list[tuple[int, int]] = []
    started: list[bool] = []

    def forward(signum, _frame, from_terminal: bool | None = None):
        if signum == signal.SIGINT:
            if said_ctrl_c and time.monotonic() - said_ctrl_c[0] >= preempt.INT_AGAIN_S:
                quit_now.append(True)  # (one waiting in C++, the rendezvous, cannot)
            if not said_ctrl_c:  # the workers' output is no terminal: they do not say it
                said_ctrl_c.append(time.monotonic())
                starting = len(procs) < nproc or any(
                    p.poll() is None and not stops_on_ctrl_c(p.pid) for p in procs)
                said = CTRL_C_STARTING if starting else preempt.CTRL_C
                quitting.extend([True] if starting else [])
                preempt.say(f"\n{said}\n")  # (a handler: one write, no print)
            if terminal_sent_it() if from_terminal is None else from_terminal:
                return  # a Ctrl-C reached every worker already
        if not started:
            reached.append((signum, len(procs)))
        for p in procs:
            if p.poll() is None:
                relay.send(p.pid, signum)

    relay = Relay(stop)
    forwarded = tuple(dict.fromkeys((*FORWARDED, *([stop] if stop else []))))
    # Handled before the workers start: a Ctrl-C in between quit this launcher at once, and
    # left its workers printing after the shell's prompt had come back.
    old = {s: signal.signal(s, forward) for s in forwarded}
    # The early catch (preempt.catch_early) ends here: what it caught is handed on; a signal
    # this launcher does not hand on ends it, as if never caught (HUP, stopping on USR2).
    early, _, before = preempt.end_early(forwarded)
    old.update(before)  # restored at the end: the handlers from before the early catch
    old_mask: set[signal.Signals] | None = None
    try:
        for worker in workers:
            if said_ctrl_c:  # a Ctrl-C while they start: those started quit, no more start
                break
            procs.append(subprocess.Popen(list(argv), env={**environ, **worker,
                                                           LAUNCHER_ENV: str(os.getpid())}))
        if not procs:  # a SIGINT before the first one started: none did
            return exit_status(-signal.SIGINT)
        started.append(True)  # from here each is handed on to all of them at once
        for signum, count in reached:
            for p in procs[count:]:
                relay.send(p.pid, signum)
        if early is not None:
            forward(early, None)
        # From here the main thread takes them with sigtimedwait, which says who sent each
        # (blocked only now: a worker started with them blocked would inherit that).
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
        failures: list[int] = []  # in the order they were seen, none that was stopped here
        counted: set[int] = set()
        deadline, stopped = None, False
        stopped_since: float | None = None  # since when every live worker is stopped
        while None in [p.poll() for p in procs]:
            relay.release()
            if not stopped:
                for i, p in enumerate(procs):
                    if p.returncode not in (None, 0) and i not in counted:
                        counted.add(i)
                        failures.append(p.returncode)
                        name(i, p)
                if failures and deadline is None:  # (none for those the group never formed for)
                    deadline = time.monotonic() + (0.0 if quitting else grace_s)
                # A stopped rank notices nothing and persists nothing: no grace for it, once
                # it stays stopped (not a debugger's or py-spy's brief ptrace stop).
                if deadline is None or not all_stopped(procs):
                    stopped_since = None
                elif stopped_since is None:
                    stopped_since = time.monotonic()
                frozen = stopped_since is not None and (
                    time.monotonic() - stopped_since > STOPPED_FOR_S)
                if frozen:
                    print("pyrecover: the ranks still running are stopped (SIGSTOP, state "
                          "T); ending them now", file=sys.stderr, flush=True)
                if quit_now or deadline is not None and (frozen or
                                                         time.monotonic() > deadline):
                    _stop_all(procs, QUIT_GRACE_S if quitting or quit_now else 10.0)
                    stopped = True
            info = signal.sigtimedwait(forwarded, 0.05)
            if info is not None:
                forward(info.si_signo, None, from_terminal=info.si_code == SI_KERNEL)
        if not stopped:
            for i, p in enumerate(procs):
                if p.returncode != 0 and i not in counted:
                    failures.append(p.returncode)
                    name(i, p)
        for rank, how in deaths if killed is not None else ():
            killed(rank, how)  # after the survivors' own records: the run's last word
        return exit_status(cause(failures) or (-signal.SIGINT if quit_now else 0))
    finally:
        _stop_all(procs)
        while old_mask is not None and signal.sigtimedwait(forwarded, 0) is not None:
            pass  # for workers that are gone: nothing to hand on
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for s, handler in old.items():
            signal.signal(s, handler)


CTRL_C_STARTING = ("pyrecover: Ctrl-C: the workers are still starting; they quit without a "
                   "checkpoint")

# The stop signals a launcher hands on to its workers.
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
# si_code of a signal the kernel sent (<asm-generic/siginfo.h>), as a terminal's Ctrl-C is: to
# its whole foreground process group, the workers too. A kill(2) from anyone is SI_USER (0).
SI_KERNEL = 0x80


def terminal_sent_it() -> bool:
    """terminal_sent_it tells whether this process's group is the foreground one of its
    controlling terminal: a Ctrl-C there goes to every process of the group, the workers
    too. Asked of the terminal itself (/dev/tty), not of stderr, which may be a pipe
    (`pyrecover train --nproc 2 2>&1 | tee log`): the launcher would then hand on a second
    SIGINT, which a worker a second later takes for "quit at once". Only a guess, for a
    SIGINT taken by a handler: spawn_local's own wait knows the sender (SI_KERNEL), and so
    hands on a `kill -INT` of the launcher even where it is in the foreground."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal: a kill -INT, SLURM, a test
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def ended(code: int) -> str:
    """ended says how a worker ended, from its return code (-N: killed by signal N)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def catching(pid: int, *signums: int) -> bool:
    """catching tells whether process `pid` handles each of `signums` (default: SIGTERM)
    itself yet, from its SigCgt mask in /proc. True where /proc cannot tell (it has no such
    file or field)."""
    mask = _caught(pid)
    return mask is None or all(mask >> (s - 1) & 1 for s in signums or (signal.SIGTERM,))


def stops_on_ctrl_c(pid: int) -> bool:
    """stops_on_ctrl_c tells whether worker `pid` has its run's stop flag (preempt.take_over),
    so that a Ctrl-C stops it after a step with a checkpoint; one still starting quits at
    once (exit 130). Told from the signals it catches: preempt.catch_early catches every one
    of EARLY_SIGNALS, and take_over gives back those the run does not stop on (three at
    least); before either it catches no SIGTERM. True where /proc cannot tell."""
    mask = _caught(pid)
    early = [preempt.parse_signal(name) for name in preempt.EARLY_SIGNALS]
    return mask is None or bool(mask >> (signal.SIGTERM - 1) & 1) and not all(
        mask >> (s - 1) & 1 for s in early)


def _caught(pid: int) -> int | None:
    """_caught is process `pid`'s SigCgt mask from /proc (bit N-1: it catches signal N),
    None where there is none."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f if b":" in line)
        return int(fields[b"SigCgt"].strip(), 16)
    except (OSError, KeyError, ValueError):
        return None


class Relay:
    """Relay hands stop signals on to a launcher's workers, its children, each once the worker
    catches it: one still in Python's start-up, before preempt.catch_early put its handlers in
    (50-100 ms), would die of the signal's default action, which the job script counts as a
    crash. Until then the signal is held, and `release` tries again.

    A worker catches stop signals once it catches SIGTERM (catch_early installs it last) and,
    for the run's stop signal `stop`, that one too (it caught TERM alone, and a HUP that stops
    the run killed it). One the run never catches (USR1 for a run that stops on USR2) goes
    once TERM is caught, and ends the worker as it always did."""

    def __init__(self, stop: int | None) -> None:
        self.stop = stop
        self.held: list[tuple[int, int]] = []  # (pid, signal); no lock: handlers append

    def send(self, pid: int, signum: int) -> None:
        """send hands `signum` on to worker `pid` now, or once it catches it."""
        if self._takes(pid, signum):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        else:
            self.held.append((pid, signum))

    def release(self) -> None:
        """release hands on each held signal whose worker catches it now, and drops those of
        workers that ended."""
        for pid, signum in list(self.held):
            fields = _stat(pid)  # a child of ours: its pid is not reused before it is reaped
            live = len(fields) > 1 and fields[0] != "Z" and fields[1] == str(os.getpid())
            if not live or self._takes(pid, signum):
                self.held.remove((pid, signum))
                if live:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signum)

    def _takes(self, pid: int, signum: int) -> bool:
        return catching(pid, signal.SIGTERM, *([signum] if signum == self.stop else []))


# A rank that found another one gone (1), or stopped cleanly (75), names no cause of its own.
NO_CAUSE = (1, 75)
# How a worker a Ctrl-C quit at once ends (a trainer's exit 130, or Python's default action).
CTRL_C_CODES = (128 + signal.SIGINT, -signal.SIGINT)


def cause(failures: list[int]) -> int:
    """cause is the exit code that says what ended the workers (0 where none failed): the
    first failure that names a cause (a hang's 76, a health check's 77, a config error's 2,
    a death by signal), else the first failure. A hung rank exits 76 once its stacks are
    written, and its peer, whose collective broke when the hung rank left, may exit 1 before
    it; the job script must still see the hang (a full test run under load met this order
    once)."""
    return next((c for c in failures if c not in NO_CAUSE), failures[0] if failures else 0)


def all_stopped(procs: list[subprocess.Popen]) -> bool:
    """all_stopped: every worker still running is stopped (a SIGSTOP, a debugger), which no
    grace period ends."""
    live = [p for p in procs if p.poll() is None]
    return bool(live) and all(_state(p.pid) in ("T", "t") for p in live)


def _state(pid: int) -> str:
    """_state is the process's state letter from /proc (R, S, D, T, ...), "" where unknown."""
    fields = _stat(pid)
    return fields[0] if fields else ""


def _stat(pid: int) -> list[str]:
    """_stat is the fields of /proc/PID/stat after the command name (state, parent pid, ...),
    [] where there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces


def _stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
        with contextlib.suppress(OSError):  # a stopped worker takes SIGTERM once continued
            os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def python_argv() -> list[str]:
    """python_argv is the command that runs this package's CLI with the current interpreter."""
    return [sys.executable, "-m", "pyrecover"]
