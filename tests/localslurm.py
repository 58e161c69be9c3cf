#!/usr/bin/env python3
"""A real, throwaway SLURM cluster on this machine, for tests.

Debian's SLURM (22.05) runs several slurmd daemons on one host, so one machine can pose as
a small cluster: N nodes (`node1`..`nodeN`, all at 127.0.0.1, each slurmd on its own port),
fake GPUs (character devices made with mknod; slurm only checks that they are devices),
munge with a private key and socket, and all state, spool and logs under one directory.
Every SLURM client and daemon is pointed at it by SLURM_CONF (`env`). A daemon's exit status
proves nothing, so `start` waits until `scontrol ping` answers and `sinfo` shows every node
idle. `stop` stops the recorded PIDs, never processes found by name. The facts behind each
setting are commented where they are used, mostly in localslurm_conf.render_slurm_conf.

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

The implementation is split over sibling modules: localslurm_conf (constants and the files
it writes), localslurm_daemons (starting the daemons, their PID records) and localslurm_procs
(the process table, stopping, the reaper). Only the standard library is used, so CI can run
this before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from localslurm_conf import (
    HOSTS_FILE,
    MAX_JOB_ID,
    MAX_SOCKET_PATH,
    TERMINAL_STATES,
    LocalSlurmError,
    add_hosts_lines,
    ensure_packages,
    is_slurm_var,
    locked,
    make_dirs,
    path_with_sbin,
    pick_free_ports,
    remove_hosts_lines,
    write_config,
)
from localslurm_daemons import (
    cancel_jobs,
    check_daemons_alive,
    load_records,
    log_tails,
    running_pids,
    start_munge,
    start_slurm,
)
from localslurm_procs import alive, kill_job_leftovers, reap, terminate, with_reapers

__all__ = ["HOSTS_FILE", "LocalSlurm", "LocalSlurmError", "TERMINAL_STATES", "parse_job_record"]


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
        """Variables to add to an environment so SLURM clients talk to this cluster.

        Debian's SLURM needs SLURM_CONF for every client and daemon: there is no usable
        default configuration to fall back on."""
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
        if running_pids(self.pids_path):
            raise LocalSlurmError(
                f"a cluster is already running from {self.root}; "
                f"stop it first: python {Path(__file__).name} stop {self.root}"
            )
        ensure_packages()
        make_dirs(self)
        if len(str(self.munge_socket)) > MAX_SOCKET_PATH:
            raise LocalSlurmError(
                f"munge socket path is longer than {MAX_SOCKET_PATH} bytes: {self.munge_socket}; "
                "use a shorter cluster directory"
            )
        try:
            start_munge(self, deadline=time.monotonic() + timeout)
            with locked():
                ports = pick_free_ports(self.nodes + 1)
                write_config(self, ctld_port=ports[0], node_ports=ports[1:])
                add_hosts_lines(self)
                start_slurm(self)
                self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop exactly the processes `start` recorded, and what their jobs left behind.

        Never by name: other clusters (another pytest worker's) run the same daemons. Safe
        to call twice, and after a failed or partial start.
        """
        records = load_records(self.pids_path)
        if alive(records.get("slurmctld")):
            cancel_jobs(self)
        slurm = {name: rec for name, rec in records.items() if name != "munged"}
        terminate(slurm, self._reap)
        kill_job_leftovers(self.spool_dir, self.conf_path)
        terminate({name: rec for name, rec in records.items() if name == "munged"}, self._reap)
        # Each reaper exits with its daemon; this only catches one that did not.
        reapers = {name: rec["reaper"] for name, rec in records.items() if rec.get("reaper")}
        terminate(reapers, self._reap)
        with locked():
            remove_hosts_lines(self)
        everything = with_reapers(records)
        still = [f"{n}={r['pid']}" for n, r in everything.items() if alive(r)]
        if still:
            raise LocalSlurmError(f"could not stop {', '.join(still)} (see {self.pids_path})")
        self.pids_path.unlink(missing_ok=True)
        self._procs.clear()
        if self.socket_root != self.root:
            shutil.rmtree(self.socket_root, ignore_errors=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until `scontrol ping` answers and `sinfo` shows every node idle.

        A daemon's exit status says nothing (they exit 0 even when they fail after forking);
        what the clients see does."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            check_daemons_alive(self)
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
                    + log_tails(self)
                )
            time.sleep(0.2)

    # -------------------------------------------------------------------- using the cluster

    def client_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment, minus any outer SLURM job's variables, plus `env`."""
        env = {k: v for k, v in os.environ.items() if not is_slurm_var(k)}
        env["PATH"] = path_with_sbin(env.get("PATH", ""))
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

    def _reap(self) -> None:
        """Collect the exit status of the reapers this object started, if they are done."""
        for proc in self._procs.values():
            proc.poll()


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
