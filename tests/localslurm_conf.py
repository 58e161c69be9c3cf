"""What a local SLURM cluster (tests/localslurm.py) is made of: its constants, the files it
writes (slurm.conf, gres.conf, cgroup.conf, the task prolog, fake GPU devices), its lines in
/etc/hosts, the packages it installs and the ports it picks.

Each setting that matters says next to it why it is there; the facts were measured with
Debian's SLURM 22.05. Standard library only, like the rest of localslurm.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localslurm import LocalSlurm


class LocalSlurmError(RuntimeError):
    """The local cluster could not be started, reached or stopped; the message says why."""


PACKAGES = ("slurm-wlm", "slurmctld", "slurmd", "slurm-client", "munge")
# Daemons live in sbin, which is not on every PATH (e.g. a non-login root shell in CI).
SBIN_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")
HOSTS_FILE = Path("/etc/hosts")
# Serialises port choice, daemon start-up and /etc/hosts edits between clusters started at
# the same time, so two clusters never pick the same port.
LOCK_FILE = Path(tempfile.gettempdir()) / "localslurm.lock"
# Below the kernel's ephemeral range (32768+), so outgoing connections never take these, and
# below the ports the job scripts' rendezvous (10000-29999, pyrecover.dist.port_for_job) and
# local runs (pyrecover.spawn.free_port) use: a daemon of one cluster once held the port a job
# of another (the other pytest worker's) needed, and the job's step failed with EADDRINUSE.
PORT_RANGE = (2000, 10000)
# A unix socket path must fit in sockaddr_un.sun_path (108 bytes with the NUL).
MAX_SOCKET_PATH = 107
# SLURM's default MaxJobId: a job id has at most its 8 digits in a step's socket name.
MAX_JOB_ID = 67043328
# The fake GPUs are character devices with NVIDIA's major number (mknod c 195 N).
NVIDIA_MAJOR = 195
# Seconds between SIGTERM and SIGKILL when slurm ends a job (slurm.conf's KillWait).
KILL_WAIT = 5

TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


# ------------------------------------------------------------------------ files it writes


def make_dirs(cluster: LocalSlurm) -> None:
    root = cluster.root
    for sub in ("state", "log", "run", "munge", "dev"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    for folder in (cluster.spool_dir, cluster.munge_socket.parent):
        folder.mkdir(parents=True, exist_ok=True)
    cluster.munge_socket.parent.chmod(0o700)


def write_config(cluster: LocalSlurm, ctld_port: int, node_ports: list[int]) -> None:
    """Every file the daemons read: slurm.conf and its siblings, and the fake GPUs."""
    root = cluster.root
    make_gpu_devices(cluster)
    (root / "plugstack.conf").write_text("")  # keep the host's SPANK plugins out
    prolog = root / "task_prolog.sh"
    # Every task, batch script included, gets SLURM_CONF even if submitted with
    # --export=NONE, so srun and scontrol inside a job find this cluster.
    export = shlex.quote(f"export SLURM_CONF={cluster.conf_path}")
    prolog.write_text(f"#!/bin/sh\necho {export}\n")
    prolog.chmod(0o755)
    cluster.conf_path.write_text(
        render_slurm_conf(cluster, ctld_port=ctld_port, node_ports=node_ports)
    )
    (root / "cgroup.conf").write_text(
        "# slurmd loads a cgroup plugin even with proctrack/pgid and task/none;\n"
        "# without this line it dies under some cgroup views.\n"
        "CgroupPlugin=cgroup/v1\n"
    )
    gres = "AutoDetect=off\n"
    if cluster.gpus_per_node:
        gres += f"Name=gpu File={root}/dev/nvidia[0-{cluster.gpus_per_node - 1}]\n"
    (root / "gres.conf").write_text(gres)


def make_gpu_devices(cluster: LocalSlurm) -> None:
    # slurm rejects regular files as GPU devices and then sets no CUDA_VISIBLE_DEVICES.
    for i in range(cluster.gpus_per_node):
        dev = cluster.root / "dev" / f"nvidia{i}"
        if dev.exists() and stat.S_ISCHR(dev.lstat().st_mode):
            continue
        dev.unlink(missing_ok=True)
        try:
            os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, i))
        except OSError as exc:
            raise LocalSlurmError(f"cannot make fake GPU device {dev}: {exc}") from exc


def render_slurm_conf(cluster: LocalSlurm, ctld_port: int, node_ports: list[int]) -> str:
    """slurm.conf for `cluster`, with slurmctld on `ctld_port` and node i's slurmd on
    `node_ports[i]`. Each setting is here for a reason measured on a 2-core machine."""
    root = cluster.root
    host = socket.gethostname().split(".")[0]
    gres = f" Gres=gpu:{cluster.gpus_per_node}" if cluster.gpus_per_node else ""
    node_lines = "".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={cluster.cpus_per_node} RealMemory={1024 * cluster.cpus_per_node}{gres} "
        "State=UNKNOWN\n"
        for name, port in zip(cluster.node_names, node_ports, strict=True)
    )
    return f"""\
# Written by tests/localslurm.py for a throwaway local cluster; regenerated on every start.
ClusterName=localslurm
# Job ids start at a random number: the rendezvous port follows from the job id
# (pyrecover.dist.port_for_job), and two clusters on one machine both counting from 1 gave
# two jobs the same port (EADDRINUSE).
FirstJobId={random.SystemRandom().randrange(1000, 5_000_000)}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Clients and daemons reach this cluster's own munged through socket=, not the system one.
# cred_expire is also how long a requeued job waits before it may start again (+1 s).
AuthInfo=socket={cluster.munge_socket},cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={cluster.spool_dir}/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={root}/plugstack.conf
TaskProlog={root}/task_prolog.sh
# pgid, not linuxproc: linuxproc left a batch script's background children running.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
# No accounting daemon: no sacct. scontrol shows finished jobs for MinJobAge seconds (an hour:
# a test module's background jobs are read after the tests before them) and jobcomp/filetxt
# keeps a record of them.
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
MinJobAge=3600
# Advertise more CPUs than the machine has; without this the nodes go INVAL.
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
KillWait={KILL_WAIT}
OverTimeLimit=0
InactiveLimit=0
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
GresTypes=gpu
# Several slurmd on one host (Debian builds SLURM with MULTIPLE_SLURMD): each node has its
# own Port, and its name resolves through a line in /etc/hosts (add_hosts_lines).
{node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


# ---------------------------------------------------------------------------- /etc/hosts


def add_hosts_lines(cluster: LocalSlurm) -> None:
    """Make the node names resolve (to 127.0.0.1), in a line tagged `cluster.hosts_marker`
    that `remove_hosts_lines` takes out again. Call under `locked()`."""
    remove_hosts_lines(cluster)
    line = f"127.0.0.1 {' '.join(cluster.node_names)} {cluster.hosts_marker}"
    text = HOSTS_FILE.read_text()
    # Mirror the file's own ending, so removing the line restores it byte for byte.
    added = f"{line}\n" if text.endswith("\n") or not text else f"\n{line}"
    rewrite_in_place(HOSTS_FILE, text + added)


def remove_hosts_lines(cluster: LocalSlurm) -> None:
    try:
        lines = HOSTS_FILE.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return
    marker = cluster.hosts_marker
    kept = [line for line in lines if not line.rstrip("\n").endswith(marker)]
    if len(kept) == len(lines):
        return
    if lines[-1].endswith(marker) and kept:
        # Ours was the last line, added without a newline after it to a file that had
        # none: take back the newline we put before it.
        kept[-1] = kept[-1].removesuffix("\n")
    rewrite_in_place(HOSTS_FILE, "".join(kept))


def rewrite_in_place(path: Path, text: str) -> None:
    # In place, not rename: /etc/hosts is often a bind mount (containers), and a rename
    # onto a mount point fails.
    with open(path, "r+") as f:
        f.write(text)
        f.truncate()


# ------------------------------------------------------------------- packages and ports


def ensure_packages() -> None:
    """apt-get install SLURM and munge unless slurmctld and munged are already present."""
    if which("slurmctld") and which("munged"):
        return
    if not shutil.which("apt-get"):
        raise LocalSlurmError(
            "slurmctld/munged not found and apt-get is missing; install SLURM and munge"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
    ):
        print(f"localslurm: SLURM is not installed; running {shlex.join(argv)}", file=sys.stderr)
        result = subprocess.run(argv, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise LocalSlurmError(
                f"{shlex.join(argv)} exited {result.returncode}:\n{result.stderr[-2000:]}"
            )
    if not (which("slurmctld") and which("munged")):
        raise LocalSlurmError(f"installed {' '.join(PACKAGES)} but slurmctld/munged still missing")


def pick_free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports nobody listens on now. Call under `locked()` and start
    the daemons before releasing it, so a concurrent start cannot pick the same ones."""
    rng = random.Random()
    ports: list[int] = []
    for _ in range(1000):
        port = rng.randrange(*PORT_RANGE)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise LocalSlurmError(f"found no {count} free ports in {PORT_RANGE}")


@contextlib.contextmanager
def locked() -> Iterator[None]:
    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------- environment and PATH


def is_slurm_var(name: str) -> bool:
    return name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))


def path_with_sbin(path: str) -> str:
    parts = [p for p in path.split(os.pathsep) if p]
    return os.pathsep.join(parts + [d for d in SBIN_DIRS if d not in parts])


def which(name: str) -> str | None:
    return shutil.which(name, path=path_with_sbin(os.environ.get("PATH", "")))


def sbin(name: str) -> str:
    found = which(name)
    if not found:
        raise LocalSlurmError(f"{name} not found on PATH or in {', '.join(SBIN_DIRS)}")
    return found
