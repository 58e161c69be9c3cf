"""Processes of a local SLURM cluster (tests/localslurm.py): reading the /proc process table,
signalling and stopping exactly the recorded processes, and the reaper each daemon runs under.

Processes are only ever stopped by recorded PID (checked against its start time) or by what
ties them to one cluster (its spool sockets, its SLURM_CONF), never by name: other clusters,
another pytest worker's say, run the same daemons. This machine's PID 1 reaps late, so a
killed process lingers as a zombie and `kill -0` still succeeds on it; whether a process
still runs is read from /proc/PID/stat instead. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


# ------------------------------------------------------------------------------ reaper


def reap(pid_file: Path, argv: list[str]) -> int:
    """Run `argv` (a daemon in the foreground), write its PID to `pid_file`, and reap every
    orphan below it at once, until the daemon exits; return the daemon's exit code.

    Why: slurmd double-forks each slurmstepd, so job processes are orphaned to PID 1, and
    this machine's PID 1 reaps late. With proctrack/pgid a step is over only when its
    process group is empty, and a zombie counts: an orphaned `srun` helper left as a zombie
    made every job end 3 s after its script (slurmstepd re-checks after 1 s, then 2 s).
    As a child subreaper this process adopts those orphans instead and reaps them.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    daemon = os.posix_spawn(argv[0], argv, os.environ)
    tmp = pid_file.with_suffix(".tmp")
    tmp.write_text(str(daemon))
    tmp.replace(pid_file)

    def forward(signum: int, _frame: object) -> None:
        send_signal(daemon, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == daemon:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code


def with_reapers(records: Mapping[str, dict]) -> dict[str, dict]:
    """Daemon records plus their reapers' records, as one flat name -> record mapping."""
    flat = dict(records)
    flat.update(
        {f"{name}-reaper": rec["reaper"] for name, rec in records.items() if rec.get("reaper")}
    )
    return flat


# ---------------------------------------------------------------------------- stopping


def terminate(records: Mapping[str, dict], poll: Callable[[], None], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; only for processes whose PID and
    start time still match the record (a recycled PID is someone else's). `poll` reaps
    the caller's own children while it waits."""
    targets = {name: rec for name, rec in records.items() if alive(rec)}
    for rec in targets.values():
        send_signal(rec["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        poll()
        if not any(alive(rec) for rec in targets.values()):
            return
        time.sleep(0.05)
    for rec in targets.values():
        if alive(rec):
            send_signal(rec["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(r) for r in targets.values()):
        poll()
        time.sleep(0.05)


def kill_job_leftovers(spool_dir: Path, conf_path: Path) -> None:
    """SIGKILL slurmstepd processes of a cluster that outlived their slurmd, and every
    process below them or carrying that cluster's job environment.

    A slurmstepd is recognised as the cluster's by the socket it keeps in `spool_dir`; a
    job process by SLURM_CONF pointing at `conf_path` together with a SLURM_JOB_ID.
    """
    protected = ancestors(os.getpid())
    spool = str(spool_dir) + os.sep
    our_sockets = {inode for inode, path in unix_sockets().items() if path.startswith(spool)}
    children = children_map()
    victims: set[int] = set()
    for pid in all_pids():
        if pid in protected:
            continue
        if socket_inodes(pid) & our_sockets or is_job_process_of(pid, conf_path):
            victims.add(pid)
            victims |= descendants(pid, children)
    victims -= protected
    for pid in victims:
        send_signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(state(p) not in (None, "Z") for p in victims):
        time.sleep(0.05)


def is_job_process_of(pid: int, conf_path: Path) -> bool:
    env = environ(pid)
    return env.get("SLURM_CONF") == str(conf_path) and "SLURM_JOB_ID" in env


# ----------------------------------------------------------------------- process table


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 is field 3, the state)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def state(pid: int) -> str | None:
    fields = proc_stat(pid)
    return fields[0] if fields else None


def starttime(pid: int) -> int | None:
    fields = proc_stat(pid)
    return int(fields[19]) if fields else None


def alive(record: Mapping | None) -> bool:
    """True if the recorded process still runs. A zombie does not count (this machine's
    PID 1 reaps late, and `kill -0` succeeds on zombies), nor does a recycled PID."""
    if not record or record.get("pid") is None:
        return False
    fields = proc_stat(record["pid"])
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return record.get("starttime") is None or int(fields[19]) == record["starttime"]


def send_signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        fields = proc_stat(pid)
        if fields:
            children.setdefault(int(fields[1]), []).append(pid)
    return children


def descendants(pid: int, children: Mapping[int, list[int]]) -> set[int]:
    found: set[int] = set()
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.add(child)
            todo.extend(children.get(child, []))
    return found


def ancestors(pid: int) -> set[int]:
    found = {pid}
    while pid > 1:
        fields = proc_stat(pid)
        if not fields:
            break
        pid = int(fields[1])
        found.add(pid)
    return found


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def unix_sockets() -> dict[str, str]:
    """Bound unix socket inode -> path, from /proc/net/unix."""
    sockets = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8:
                sockets[fields[6]] = fields[7]
    return sockets


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes
