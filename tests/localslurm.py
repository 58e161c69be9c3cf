#!/usr/bin/env python3
"""A real, throwaway SLURM cluster on this machine, for tests.

Debian's SLURM (22.05) runs several slurmd daemons on one host, so one machine can pose as
a small cluster: N nodes (`node1`..`nodeN`, all at 127.0.0.1, each slurmd on its own port),
fake GPUs (character devices made with mknod; slurm only checks that they are devices),
munge with a private key and socket, and all state, spool and logs under one directory.
Facts this relies on were measured here; see /work/shared/SLURM-NOTES.md.

As a script (needs root)::

    eval "$(python tests/localslurm.py start /tmp/slurm --nodes 2)"
    sbatch --nodes 2 --ntasks-per-node 2 job.sh
    python tests/localslurm.py stop /tmp/slurm

As a library::

    cluster = LocalSlurm(tmp_path, nodes=2)
    cluster.start()
    try:
        job_id = cluster.submit("#!/bin/bash\\nsrun hostname\\n", "--nodes", "2", cwd=tmp_path)
        assert cluster.wait_job(job_id, timeout=30) == "COMPLETED"
    finally:
        cluster.stop()

Only the standard library is used, so CI can run this before anything else is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

__all__ = ["LocalSlurm", "LocalSlurmError", "TERMINAL_STATES", "parse_job_record"]

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
NVIDIA_MAJOR = 195
# Seconds between SIGTERM and SIGKILL when slurm ends a job (the notes' KillWait=5).
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


class LocalSlurmError(RuntimeError):
    """The local cluster could not be started, reached or stopped; the message says why."""


class LocalSlurm:
    """A local SLURM cluster whose files all live under `root`.

    `start()` and `stop()` bracket its life; `env` holds the variables that point `sbatch`,
    `squeue` and `scontrol` at it. The PIDs it starts are kept in `root/pids.json`, so a
    different process (`python tests/localslurm.py stop ROOT`) can stop exactly those.
    """

    def __init__(
        self, root: Path | str, nodes: int = 2, cpus_per_node: int = 4, gpus_per_node: int = 4
    ) -> None:
        self.root = Path(root).absolute()
        if nodes < 1 or cpus_per_node < 1 or gpus_per_node < 0:
            raise ValueError(
                f"need nodes >= 1, cpus_per_node >= 1, gpus_per_node >= 0; "
                f"got {nodes}, {cpus_per_node}, {gpus_per_node}"
            )
        if re.search(r"\s", str(self.root)):
            # slurm.conf and munged arguments do not survive whitespace in paths.
            raise ValueError(f"the cluster directory must not contain whitespace: {self.root!r}")
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.gpus_per_node = gpus_per_node
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # ----------------------------------------------------------------------------- paths

    @property
    def conf_path(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def pids_path(self) -> Path:
        return self.root / "pids.json"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def socket_root(self) -> Path:
        """Where the unix sockets go: `root`, unless a step's socket in slurmd's spool
        (`spool/<node>/<node>_<job id>.<step id>`) would not fit in a socket path there (a
        pytest-xdist worker's tmp_path is 10 bytes longer than pytest's): then a short folder
        named after `root` in /tmp, which `start` makes and `stop` removes."""
        node = self.node_names[-1]
        step = f"spool/{node}/{node}_{MAX_JOB_ID}.4294967291"  # the batch step's id
        if len(str(self.root / step)) <= MAX_SOCKET_PATH:
            return self.root
        return Path("/tmp") / f"localslurm-{hashlib.sha256(bytes(self.root)).hexdigest()[:12]}"

    @property
    def spool_dir(self) -> Path:
        return self.socket_root / "spool"

    @property
    def munge_socket(self) -> Path:
        return self.socket_root / "munge" / "munge.socket"

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    @property
    def env(self) -> dict[str, str]:
        """Variables to add to an environment so SLURM clients talk to this cluster."""
        return {"SLURM_CONF": str(self.conf_path)}

    @property
    def hosts_marker(self) -> str:
        """The comment that tags this cluster's lines in /etc/hosts."""
        return f"# localslurm {self.root}"

    # ----------------------------------------------------------------------- start, stop

    def start(self, timeout: float = 60.0) -> None:
        """Install SLURM if missing, write the configuration, start the daemons, wait.

        Returns once `scontrol ping` answers and every node is idle. On any failure the
        daemons started so far are stopped and `LocalSlurmError` says what went wrong.
        """
        if sys.platform != "linux":
            raise LocalSlurmError(f"a local SLURM cluster needs Linux, not {sys.platform}")
        if os.geteuid() != 0:
            raise LocalSlurmError(
                "a local SLURM cluster needs root (slurmd, mknod, /etc/hosts); run as root"
            )
        if self._running_pids():
            raise LocalSlurmError(
                f"a cluster is already running from {self.root}; "
                f"stop it first: python {Path(__file__).name} stop {self.root}"
            )
        ensure_packages()
        self._make_dirs()
        if len(str(self.munge_socket)) > MAX_SOCKET_PATH:
            raise LocalSlurmError(
                f"munge socket path is longer than {MAX_SOCKET_PATH} bytes: {self.munge_socket}; "
                "use a shorter cluster directory"
            )
        try:
            self._start_munge(deadline=time.monotonic() + timeout)
            with _locked():
                ports = pick_free_ports(self.nodes + 1)
                self._write_config(ctld_port=ports[0], node_ports=ports[1:])
                self._add_hosts_lines()
                self._start_slurm()
                self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop exactly the processes `start` recorded, and what their jobs left behind.

        Safe to call twice, and after a failed or partial start.
        """
        records = self._load_records()
        if _alive(records.get("slurmctld")):
            self._cancel_jobs()
        slurm = {name: rec for name, rec in records.items() if name != "munged"}
        self._terminate(slurm)
        self._kill_job_leftovers()
        self._terminate({name: rec for name, rec in records.items() if name == "munged"})
        # Each reaper exits with its daemon; this only catches one that did not.
        self._terminate({name: rec["reaper"] for name, rec in records.items() if rec.get("reaper")})
        with _locked():
            self._remove_hosts_lines()
        everything = _with_reapers(records)
        still = [f"{n}={r['pid']}" for n, r in everything.items() if _alive(r)]
        if still:
            raise LocalSlurmError(f"could not stop {', '.join(still)} (see {self.pids_path})")
        self.pids_path.unlink(missing_ok=True)
        self._procs.clear()
        if self.socket_root != self.root:
            shutil.rmtree(self.socket_root, ignore_errors=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until `scontrol ping` answers and `sinfo` shows every node idle."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            self._check_daemons_alive()
            ping = self.run("scontrol", "ping", check=False, timeout=10)
            if ping.returncode == 0 and "UP" in ping.stdout:
                info = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
                states = dict(line.split() for line in info.stdout.splitlines() if line.strip())
                if info.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names):
                    return
                last = f"sinfo: {info.stdout.strip() or info.stderr.strip()}"
            else:
                last = f"scontrol ping: {(ping.stdout + ping.stderr).strip()}"
            if time.monotonic() > deadline:
                raise LocalSlurmError(
                    f"cluster in {self.root} not ready after {timeout:.0f}s ({last})\n"
                    + self._log_tails()
                )
            time.sleep(0.2)

    # -------------------------------------------------------------------- using the cluster

    def client_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment, minus any outer SLURM job's variables, plus `env`."""
        env = {k: v for k, v in os.environ.items() if not _is_slurm_var(k)}
        env["PATH"] = _path_with_sbin(env.get("PATH", ""))
        env.update(self.env)
        env.update(extra or {})
        return env

    def run(
        self,
        *argv: str,
        check: bool = True,
        timeout: float = 30.0,
        input: str | None = None,
        cwd: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster and capture its output."""
        try:
            result = subprocess.run(
                argv,
                env=self.client_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                input=input,
                cwd=cwd,
            )
        except subprocess.TimeoutExpired as exc:
            raise LocalSlurmError(f"{shlex.join(argv)} did not answer within {timeout}s") from exc
        if check and result.returncode != 0:
            raise LocalSlurmError(
                f"{shlex.join(argv)} exited {result.returncode}: {result.stderr.strip()}"
            )
        return result

    def submit(self, script: str, *sbatch_args: str, cwd: Path | str | None = None) -> int:
        """Submit a batch script given as text; return the job id.

        The job's default output file, slurm-<id>.out, lands in `cwd`.
        """
        out = self.run("sbatch", "--parsable", *sbatch_args, input=script, cwd=cwd)
        return int(out.stdout.strip().split(";")[0])

    def cancel(self, job_id: int | str) -> None:
        """Cancel a job for good, as `pyrecover cancel` does: a pyrecover job script takes a
        plain scancel's SIGTERM for a preemption and would requeue itself (and go on using
        the machine for the rest of the tests), so the job is made non-requeueable first."""
        self.run("scontrol", "update", f"JobId={job_id}", "Requeue=0", check=False)
        self.run("scancel", str(job_id), check=False)

    def job_info(self, job_id: int | str) -> dict[str, str]:
        """The job's record from `scontrol show job -o`, as a dict of its fields."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return parse_job_record(out.stdout.splitlines()[0])

    def job_state(self, job_id: int | str) -> str:
        """The job's state word, e.g. RUNNING or COMPLETED."""
        return self.job_info(job_id)["JobState"].split()[0]

    def wait_job(
        self,
        job_id: int | str,
        states: Iterable[str] = TERMINAL_STATES,
        timeout: float = 60.0,
        poll: float = 0.2,
    ) -> str:
        """Poll `scontrol show job` until the job is in one of `states`; return that state.

        Raises TimeoutError naming the last state seen: a job that can never fit
        (say `--nodes 3` on two nodes) stays PENDING forever.
        """
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            state = info["JobState"].split()[0]
            if state in wanted:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still {state} (Reason={info.get('Reason')}) after "
                    f"{timeout}s, waiting for {sorted(wanted)}"
                )
            time.sleep(poll)

    # ------------------------------------------------------------------------ internals

    def _make_dirs(self) -> None:
        for sub in ("state", "log", "run", "munge", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        for folder in (self.spool_dir, self.munge_socket.parent):
            folder.mkdir(parents=True, exist_ok=True)
        self.munge_socket.parent.chmod(0o700)

    def _start_munge(self, deadline: float) -> None:
        munge_dir = self.root / "munge"
        key = munge_dir / "munge.key"
        key.unlink(missing_ok=True)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        self.munge_socket.unlink(missing_ok=True)
        self._spawn(
            "munged",
            [
                _sbin("munged"),
                "--foreground",
                # Only root talks to this munged, and the socket may sit below a private
                # (0700) directory such as pytest's tmp dirs, which munged rejects without this.
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={self.log_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
        )
        while not self.munge_socket.exists():
            self._check_daemons_alive()
            if time.monotonic() > deadline:
                raise LocalSlurmError(
                    f"munged made no socket at {self.munge_socket}\n" + self._log_tails()
                )
            time.sleep(0.05)

    def _write_config(self, ctld_port: int, node_ports: list[int]) -> None:
        self._make_gpu_devices()
        (self.root / "plugstack.conf").write_text("")  # keep the host's SPANK plugins out
        prolog = self.root / "task_prolog.sh"
        # Every task, batch script included, gets SLURM_CONF even if submitted with
        # --export=NONE, so srun and scontrol inside a job find this cluster.
        export = shlex.quote(f"export SLURM_CONF={self.conf_path}")
        prolog.write_text(f"#!/bin/sh\necho {export}\n")
        prolog.chmod(0o755)
        self.conf_path.write_text(
            render_slurm_conf(self, ctld_port=ctld_port, node_ports=node_ports)
        )
        (self.root / "cgroup.conf").write_text(
            "# slurmd loads a cgroup plugin even with proctrack/pgid and task/none;\n"
            "# without this line it dies under some cgroup views.\n"
            "CgroupPlugin=cgroup/v1\n"
        )
        gres = "AutoDetect=off\n"
        if self.gpus_per_node:
            gres += f"Name=gpu File={self.root}/dev/nvidia[0-{self.gpus_per_node - 1}]\n"
        (self.root / "gres.conf").write_text(gres)

    def _make_gpu_devices(self) -> None:
        # slurm rejects regular files as GPU devices and then sets no CUDA_VISIBLE_DEVICES.
        for i in range(self.gpus_per_node):
            dev = self.root / "dev" / f"nvidia{i}"
            if dev.exists() and stat.S_ISCHR(dev.lstat().st_mode):
                continue
            dev.unlink(missing_ok=True)
            try:
                os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, i))
            except OSError as exc:
                raise LocalSlurmError(f"cannot make fake GPU device {dev}: {exc}") from exc

    def _start_slurm(self) -> None:
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf_path)])
        for node in self.node_names:
            self._spawn(
                f"slurmd-{node}",
                [_sbin("slurmd"), "-D", "-N", node, "-f", str(self.conf_path)],
            )

    def _spawn(self, name: str, argv: list[str], timeout: float = 10.0) -> None:
        """Start `argv` under its own `reap` process (see there for why) and record both."""
        pid_file = self.root / "run" / f"{name}.daemon-pid"
        pid_file.unlink(missing_ok=True)
        with open(self.log_dir / f"{name}.out", "ab") as out:
            reaper = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).absolute()),
                    "_reap",
                    str(pid_file),
                    "--",
                    *argv,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.client_env(),
                cwd=self.root,
                start_new_session=True,
            )
        self._procs[name] = reaper
        reaper_record = {"pid": reaper.pid, "starttime": _starttime(reaper.pid)}
        self._record(name, {"pid": None, "argv": argv, "reaper": reaper_record})
        deadline = time.monotonic() + timeout
        while not pid_file.exists():
            self._check_daemons_alive()
            if time.monotonic() > deadline:
                raise LocalSlurmError(
                    f"{name} did not start within {timeout}s\n" + self._log_tails()
                )
            time.sleep(0.01)
        pid = int(pid_file.read_text())
        self._record(
            name, {"pid": pid, "starttime": _starttime(pid), "argv": argv, "reaper": reaper_record}
        )

    def _record(self, name: str, record: dict) -> None:
        records = self._load_records()
        records[name] = record
        tmp = self.pids_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"root": str(self.root), "processes": records}, indent=1))
        tmp.replace(self.pids_path)

    def _load_records(self) -> dict[str, dict]:
        try:
            return json.loads(self.pids_path.read_text())["processes"]
        except FileNotFoundError:
            return {}

    def _running_pids(self) -> list[int]:
        return [r["pid"] for r in _with_reapers(self._load_records()).values() if _alive(r)]

    def _check_daemons_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise LocalSlurmError(
                    f"{name} exited with {proc.returncode} during start-up\n" + self._log_tails()
                )

    def _log_tails(self, lines: int = 15) -> str:
        parts = []
        for log in sorted(self.log_dir.glob("*")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            if text:
                parts.append(f"--- {log} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(parts)

    def _cancel_jobs(self) -> None:
        """Cancel every job and give slurm a moment to end them; a throwaway cluster
        should not leave job processes behind. Best effort: the sweep after stopping the
        daemons catches whatever this misses."""
        try:
            listed = self.run("squeue", "-h", "-o", "%A", check=False, timeout=10)
            ids = listed.stdout.split()
            if not ids:
                return
            self.run("scancel", *ids, check=False, timeout=10)
            deadline = time.monotonic() + KILL_WAIT + 3
            while time.monotonic() < deadline:
                left = self.run(
                    "squeue", "-h", "-t", "R,CG,S,ST", "-o", "%A", check=False, timeout=10
                )
                if left.returncode != 0 or not left.stdout.split():
                    return
                time.sleep(0.2)
        except LocalSlurmError:
            return

    def _terminate(self, records: Mapping[str, dict], grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; only for processes whose PID and
        start time still match the record (a recycled PID is someone else's)."""
        targets = {name: rec for name, rec in records.items() if _alive(rec)}
        for rec in targets.values():
            _signal(rec["pid"], signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            self._reap()
            if not any(_alive(rec) for rec in targets.values()):
                return
            time.sleep(0.05)
        for rec in targets.values():
            if _alive(rec):
                _signal(rec["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(r) for r in targets.values()):
            self._reap()
            time.sleep(0.05)

    def _reap(self) -> None:
        for proc in self._procs.values():
            proc.poll()

    def _kill_job_leftovers(self) -> None:
        """SIGKILL slurmstepd processes of this cluster that outlived their slurmd, and
        every process below them or carrying this cluster's job environment.

        A slurmstepd is recognised as ours by the socket it keeps in our spool directory;
        a job process by SLURM_CONF pointing at our config together with a SLURM_JOB_ID.
        """
        protected = _ancestors(os.getpid())
        spool = str(self.spool_dir) + os.sep
        our_sockets = {inode for inode, path in _unix_sockets().items() if path.startswith(spool)}
        children = _children_map()
        victims: set[int] = set()
        for pid in _all_pids():
            if pid in protected:
                continue
            if _socket_inodes(pid) & our_sockets or self._is_our_job_process(pid):
                victims.add(pid)
                victims |= _descendants(pid, children)
        victims -= protected
        for pid in victims:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_state(p) not in (None, "Z") for p in victims):
            time.sleep(0.05)

    def _is_our_job_process(self, pid: int) -> bool:
        env = _environ(pid)
        return env.get("SLURM_CONF") == str(self.conf_path) and "SLURM_JOB_ID" in env

    def _add_hosts_lines(self) -> None:
        self._remove_hosts_lines()
        line = f"127.0.0.1 {' '.join(self.node_names)} {self.hosts_marker}"
        text = HOSTS_FILE.read_text()
        # Mirror the file's own ending, so removing the line restores it byte for byte.
        added = f"{line}\n" if text.endswith("\n") or not text else f"\n{line}"
        _rewrite_in_place(HOSTS_FILE, text + added)

    def _remove_hosts_lines(self) -> None:
        try:
            lines = HOSTS_FILE.read_text().splitlines(keepends=True)
        except FileNotFoundError:
            return
        kept = [line for line in lines if not line.rstrip("\n").endswith(self.hosts_marker)]
        if len(kept) == len(lines):
            return
        if lines[-1].endswith(self.hosts_marker) and kept:
            # Ours was the last line, added without a newline after it to a file that had
            # none: take back the newline we put before it.
            kept[-1] = kept[-1].removesuffix("\n")
        _rewrite_in_place(HOSTS_FILE, "".join(kept))


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
{node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def parse_job_record(line: str) -> dict[str, str]:
    """Fields of one `scontrol show job -o` line: `JobId=5 JobName=x JobState=RUNNING ...`.

    Values may contain spaces (Command, Reason text), so a field runs up to the next
    ` Key=`, not the next space.
    """
    keys = list(re.finditer(r"(?:^|\s)([A-Za-z][\w/:]*)=", line.strip()))
    if not keys:
        raise ValueError(f"not a `scontrol show job -o` record: {line!r}")
    text = line.strip()
    record = {}
    for this, after in zip(keys, [*keys[1:], None], strict=True):
        end = after.start() if after else len(text)
        record[this.group(1)] = text[this.end() : end]
    return record


def ensure_packages() -> None:
    """apt-get install SLURM and munge unless slurmctld and munged are already present."""
    if _which("slurmctld") and _which("munged"):
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
    if not (_which("slurmctld") and _which("munged")):
        raise LocalSlurmError(f"installed {' '.join(PACKAGES)} but slurmctld/munged still missing")


def pick_free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports nobody listens on now. Call under `_locked()` and start
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


# ------------------------------------------------------------------------------ reaper

PR_SET_CHILD_SUBREAPER = 36


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
        _signal(daemon, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == daemon:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code


def _with_reapers(records: Mapping[str, dict]) -> dict[str, dict]:
    """Daemon records plus their reapers' records, as one flat name -> record mapping."""
    flat = dict(records)
    flat.update(
        {f"{name}-reaper": rec["reaper"] for name, rec in records.items() if rec.get("reaper")}
    )
    return flat


# ----------------------------------------------------------------------- process helpers


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (index 0 is field 3, the state)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def _state(pid: int) -> str | None:
    fields = _proc_stat(pid)
    return fields[0] if fields else None


def _starttime(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def _alive(record: Mapping | None) -> bool:
    """True if the recorded process still runs. A zombie does not count (this machine's
    PID 1 reaps late, and `kill -0` succeeds on zombies), nor does a recycled PID."""
    if not record or record.get("pid") is None:
        return False
    fields = _proc_stat(record["pid"])
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return record.get("starttime") is None or int(fields[19]) == record["starttime"]


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _proc_stat(pid)
        if fields:
            children.setdefault(int(fields[1]), []).append(pid)
    return children


def _descendants(pid: int, children: Mapping[int, list[int]]) -> set[int]:
    found: set[int] = set()
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.add(child)
            todo.extend(children.get(child, []))
    return found


def _ancestors(pid: int) -> set[int]:
    found = {pid}
    while pid > 1:
        fields = _proc_stat(pid)
        if not fields:
            break
        pid = int(fields[1])
        found.add(pid)
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _unix_sockets() -> dict[str, str]:
    """Bound unix socket inode -> path, from /proc/net/unix."""
    sockets = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8:
                sockets[fields[6]] = fields[7]
    return sockets


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


# ------------------------------------------------------------------------- small helpers


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _rewrite_in_place(path: Path, text: str) -> None:
    # In place, not rename: /etc/hosts is often a bind mount (containers), and a rename
    # onto a mount point fails.
    with open(path, "r+") as f:
        f.write(text)
        f.truncate()


def _is_slurm_var(name: str) -> bool:
    return name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))


def _path_with_sbin(path: str) -> str:
    parts = [p for p in path.split(os.pathsep) if p]
    return os.pathsep.join(parts + [d for d in SBIN_DIRS if d not in parts])


def _which(name: str) -> str | None:
    return shutil.which(name, path=_path_with_sbin(os.environ.get("PATH", "")))


def _sbin(name: str) -> str:
    found = _which(name)
    if not found:
        raise LocalSlurmError(f"{name} not found on PATH or in {', '.join(SBIN_DIRS)}")
    return found


# ----------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_reap"]:  # internal: `_reap PID_FILE -- DAEMON ARGS...`, see reap()
        return reap(Path(argv[1]), argv[3:])
    parser = argparse.ArgumentParser(
        prog="localslurm", description="A throwaway local SLURM cluster for tests (needs root)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a cluster; prints `export SLURM_CONF=...`")
    start.add_argument("dir", type=Path)
    start.add_argument("--nodes", type=int, default=2)
    start.add_argument("--cpus-per-node", type=int, default=4)
    start.add_argument("--gpus-per-node", type=int, default=4)
    start.add_argument("--timeout", type=float, default=60.0)
    stop = sub.add_parser("stop", help="stop the cluster started in DIR")
    stop.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "start":
            cluster = LocalSlurm(args.dir, args.nodes, args.cpus_per_node, args.gpus_per_node)
            began = time.monotonic()
            cluster.start(timeout=args.timeout)
            print(
                f"localslurm: {args.nodes} nodes ready in {time.monotonic() - began:.1f}s; "
                f"stop with: python {sys.argv[0]} stop {cluster.root}",
                file=sys.stderr,
            )
            print(f"export SLURM_CONF={shlex.quote(str(cluster.conf_path))}")
        else:
            LocalSlurm(args.dir).stop()
    except (LocalSlurmError, ValueError) as exc:
        print(f"localslurm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
