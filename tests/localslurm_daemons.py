"""The daemons of a local SLURM cluster (tests/localslurm.py): starting munged, slurmctld and
one slurmd per node, each under its own reaper, recording their PIDs in `root/pids.json`,
reading their logs when something fails, and cancelling the jobs before they stop.

These are LocalSlurm's private parts, as functions of the cluster. Standard library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from localslurm_conf import KILL_WAIT, LocalSlurmError, sbin
from localslurm_procs import alive, starttime, with_reapers

if TYPE_CHECKING:
    from localslurm import LocalSlurm

# The script each reaper runs as: `localslurm.py _reap PID_FILE -- DAEMON ARGS...`.
SCRIPT = Path(__file__).absolute().with_name("localslurm.py")


def start_munge(cluster: LocalSlurm, deadline: float) -> None:
    """A munged with a fresh private key, on the cluster's own socket (slurm.conf's
    AuthInfo=socket=...); returns once the socket is there."""
    munge_dir = cluster.root / "munge"
    key = munge_dir / "munge.key"
    key.unlink(missing_ok=True)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    cluster.munge_socket.unlink(missing_ok=True)
    spawn(
        cluster,
        "munged",
        [
            sbin("munged"),
            "--foreground",
            # Only root talks to this munged, and the socket may sit below a private
            # (0700) directory such as pytest's tmp dirs, which munged rejects without this.
            "--force",
            f"--socket={cluster.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}",
            f"--log-file={cluster.log_dir / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ],
    )
    while not cluster.munge_socket.exists():
        check_daemons_alive(cluster)
        if time.monotonic() > deadline:
            raise LocalSlurmError(
                f"munged made no socket at {cluster.munge_socket}\n" + log_tails(cluster)
            )
        time.sleep(0.05)


def start_slurm(cluster: LocalSlurm) -> None:
    """slurmctld, then one slurmd per node (`-N node`: several on one host), all in the
    foreground (-D) and all pointed at the cluster's slurm.conf."""
    conf = str(cluster.conf_path)
    spawn(cluster, "slurmctld", [sbin("slurmctld"), "-D", "-c", "-i", "-f", conf])
    for node in cluster.node_names:
        spawn(cluster, f"slurmd-{node}", [sbin("slurmd"), "-D", "-N", node, "-f", conf])


def spawn(cluster: LocalSlurm, name: str, argv: list[str], timeout: float = 10.0) -> None:
    """Start `argv` under its own reaper (localslurm_procs.reap, which says why) and record
    both in pids.json."""
    pid_file = cluster.root / "run" / f"{name}.daemon-pid"
    pid_file.unlink(missing_ok=True)
    with open(cluster.log_dir / f"{name}.out", "ab") as out:
        reaper = subprocess.Popen(
            [sys.executable, str(SCRIPT), "_reap", str(pid_file), "--", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            # The daemons need SLURM_CONF (and munged's socket path in slurm.conf) as much
            # as the clients do; an outer SLURM job's variables are kept out.
            env=cluster.client_env(),
            cwd=cluster.root,
            start_new_session=True,
        )
    cluster._procs[name] = reaper
    reaper_record = {"pid": reaper.pid, "starttime": starttime(reaper.pid)}
    record(cluster, name, {"pid": None, "argv": argv, "reaper": reaper_record})
    deadline = time.monotonic() + timeout
    while not pid_file.exists():
        check_daemons_alive(cluster)
        if time.monotonic() > deadline:
            raise LocalSlurmError(f"{name} did not start within {timeout}s\n" + log_tails(cluster))
        time.sleep(0.01)
    pid = int(pid_file.read_text())
    record(
        cluster,
        name,
        {"pid": pid, "starttime": starttime(pid), "argv": argv, "reaper": reaper_record},
    )


def record(cluster: LocalSlurm, name: str, rec: dict) -> None:
    """Set `name`'s record in pids.json (written whole, then renamed into place)."""
    records = load_records(cluster.pids_path)
    records[name] = rec
    tmp = cluster.pids_path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"root": str(cluster.root), "processes": records}, indent=1))
    tmp.replace(cluster.pids_path)


def load_records(pids_path: Path) -> dict[str, dict]:
    try:
        return json.loads(pids_path.read_text())["processes"]
    except FileNotFoundError:
        return {}


def running_pids(pids_path: Path) -> list[int]:
    """The recorded daemons and reapers that still run."""
    return [r["pid"] for r in with_reapers(load_records(pids_path)).values() if alive(r)]


def check_daemons_alive(cluster: LocalSlurm) -> None:
    """Raise if a reaper this process started has exited (so has its daemon)."""
    for name, proc in cluster._procs.items():
        if proc.poll() is not None:
            raise LocalSlurmError(
                f"{name} exited with {proc.returncode} during start-up\n" + log_tails(cluster)
            )


def log_tails(cluster: LocalSlurm, lines: int = 15) -> str:
    parts = []
    for log in sorted(cluster.log_dir.glob("*")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        if text:
            parts.append(f"--- {log} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(parts)


def cancel_jobs(cluster: LocalSlurm) -> None:
    """Cancel every job and give slurm a moment to end them; a throwaway cluster
    should not leave job processes behind. Best effort: the sweep after stopping the
    daemons (localslurm_procs.kill_job_leftovers) catches whatever this misses."""
    try:
        listed = cluster.run("squeue", "-h", "-o", "%A", check=False, timeout=10)
        ids = listed.stdout.split()
        if not ids:
            return
        cluster.run("scancel", *ids, check=False, timeout=10)
        deadline = time.monotonic() + KILL_WAIT + 3
        while time.monotonic() < deadline:
            left = cluster.run(
                "squeue", "-h", "-t", "R,CG,S,ST", "-o", "%A", check=False, timeout=10
            )
            if left.returncode != 0 or not left.stdout.split():
                return
            time.sleep(0.2)
    except LocalSlurmError:
        return
