"""The local SLURM cluster is real: jobs span two nodes, get ranks and GPUs, can talk over
TCP, and stopping the cluster leaves nothing behind."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import is_running
from localslurm import HOSTS_FILE, LocalSlurm, parse_job_record

pytestmark = pytest.mark.slurm

LOCALSLURM = Path(__file__).resolve().parents[1] / "localslurm.py"
TIMEOUT = 120  # bounds a wait that fails; a passing run never waits this long


def run_job(cluster: LocalSlurm, tmp_path: Path, body: str, *sbatch_args: str) -> tuple[str, str]:
    """Submit `body` as a bash batch script; wait for it; return (final state, output)."""
    out = tmp_path / "job.out"
    job_id = cluster.submit(
        "#!/bin/bash\nset -eu\n" + textwrap.dedent(body),
        "--output",
        str(out),
        *sbatch_args,
        cwd=tmp_path,
    )
    state = cluster.wait_job(job_id, timeout=TIMEOUT)
    return state, out.read_text() if out.exists() else ""


def task_lines(output: str, tag: str) -> list[list[str]]:
    return sorted(line.split()[1:] for line in output.splitlines() if line.startswith(tag))


def test_a_two_node_job_runs_four_ranked_tasks_across_both_nodes(local_slurm, tmp_path):
    out = tmp_path / "job.out"
    job_id = local_slurm.submit(
        textwrap.dedent("""\
            #!/bin/bash
            set -eu
            echo "hosts $(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\\n' ' ')"
            srun bash -c 'echo "task $SLURM_PROCID $SLURM_NODEID $SLURMD_NODENAME $SLURM_NTASKS"'
        """),
        "--nodes",
        "2",
        "--ntasks-per-node",
        "2",
        "--output",
        str(out),
        cwd=tmp_path,
    )

    assert local_slurm.wait_job(job_id, timeout=TIMEOUT) == "COMPLETED", out.read_text()
    output = out.read_text()
    assert task_lines(output, "task") == [
        ["0", "0", "node1", "4"],
        ["1", "0", "node1", "4"],
        ["2", "1", "node2", "4"],
        ["3", "1", "node2", "4"],
    ]
    assert task_lines(output, "hosts") == [["node1", "node2"]]
    info = local_slurm.job_info(job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
    assert (info["NodeList"], info["NumNodes"], info["NumTasks"]) == ("node[1-2]", "2", "4")


def test_gpus_per_node_gives_every_task_cuda_visible_devices(local_slurm, tmp_path):
    state, output = run_job(
        local_slurm,
        tmp_path,
        """\
        srun bash -c 'echo "all $SLURM_PROCID $CUDA_VISIBLE_DEVICES"'
        srun --gpus-per-task 1 bash -c 'echo "one $SLURM_PROCID $CUDA_VISIBLE_DEVICES"'
        """,
        "--nodes",
        "2",
        "--ntasks-per-node",
        "2",
        "--gpus-per-node",
        "4",
    )

    assert state == "COMPLETED", output
    assert task_lines(output, "all") == [[str(rank), "0,1,2,3"] for rank in range(4)]
    one = task_lines(output, "one")
    assert [rank for rank, _ in one] == ["0", "1", "2", "3"]
    assert all(len(devices.split(",")) == 1 for _, devices in one)


def test_two_tasks_on_two_nodes_rendezvous_over_tcp_at_the_first_nodes_address(
    local_slurm, tmp_path
):
    # Rank 0 binds a port the kernel picks and tells rank 1 through the shared folder: a
    # port picked here and bound there later could be taken in between.
    port_file = tmp_path / "rendezvous.port"
    program = tmp_path / "rendezvous.py"
    program.write_text(
        textwrap.dedent(f"""\
        import os, socket, subprocess, time
        first = subprocess.run(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
            capture_output=True, text=True, check=True,
        ).stdout.split()[0]
        addr = socket.gethostbyname(first)
        rank = int(os.environ["SLURM_PROCID"])
        port_file = {str(port_file)!r}
        if rank == 0:
            server = socket.create_server((addr, 0))
            with open(port_file + ".tmp", "w") as f:
                f.write(str(server.getsockname()[1]))
            os.rename(port_file + ".tmp", port_file)
            conn, _ = server.accept()
            conn.sendall(b"welcome " + conn.recv(100))
            print("rank0", first, addr, "served", flush=True)
        else:
            deadline = time.monotonic() + {TIMEOUT}
            while not os.path.exists(port_file):
                if time.monotonic() > deadline:
                    raise TimeoutError("rank 0 never said its port")
                time.sleep(0.05)
            with open(port_file) as f:
                conn = socket.create_connection((addr, int(f.read())), timeout={TIMEOUT})
            conn.sendall(b"rank1 from " + os.environ["SLURMD_NODENAME"].encode())
            print("rank1", conn.recv(100).decode(), flush=True)
    """)
    )

    state, output = run_job(
        local_slurm,
        tmp_path,
        f"srun {shlex.quote(sys.executable)} {shlex.quote(str(program))}\n",
        "--nodes",
        "2",
        "--ntasks-per-node",
        "1",
    )

    assert state == "COMPLETED", output
    assert "rank0 node1 127.0.0.1 served" in output
    assert "rank1 welcome rank1 from node2" in output


def test_a_job_submitted_with_export_none_still_reaches_the_cluster(local_slurm, tmp_path):
    state, output = run_job(
        local_slurm,
        tmp_path,
        'echo "conf $SLURM_CONF"\nscontrol show job "$SLURM_JOB_ID" | grep -o "JobState=RUNNING"\n',
        "--export",
        "NONE",
    )

    assert state == "COMPLETED", output
    assert f"conf {local_slurm.conf_path}" in output
    assert "JobState=RUNNING" in output


def test_stop_cancels_running_jobs_and_leaves_none_of_its_processes_alive(tmp_path):
    # A folder too deep for the batch step's socket in slurmd's spool (sun_path's 108 bytes):
    # the sockets go to a short folder of their own, which stop removes.
    root = tmp_path / ("deep-" * 12) / "cluster"
    cluster = LocalSlurm(root, nodes=1, cpus_per_node=2, gpus_per_node=0)
    assert len(str(root / "spool/node1/node1_1234567.4294967291")) > 107
    assert cluster.socket_root != root and not cluster.spool_dir.is_relative_to(root)
    cluster.start()
    try:
        pid_file = tmp_path / "sleep.pid"
        job_id = cluster.submit(
            f"#!/bin/bash\nsleep 300 &\necho $! > {pid_file}\nwait\n", cwd=tmp_path
        )
        cluster.wait_job(job_id, states={"RUNNING"}, timeout=TIMEOUT)
        wait_for_file(pid_file)
        started = json.loads(cluster.pids_path.read_text())["processes"]
        assert set(started) == {"munged", "slurmctld", "slurmd-node1"}
        assert cluster.hosts_marker in HOSTS_FILE.read_text()
    finally:
        cluster.stop()

    pids = [rec["pid"] for rec in started.values()] + [int(pid_file.read_text())]
    assert [pid for pid in pids if is_running(pid)] == []
    assert cluster.hosts_marker not in HOSTS_FILE.read_text()
    assert not cluster.pids_path.exists() and not cluster.socket_root.exists()
    cluster.stop()  # a second stop is harmless


def test_the_command_line_starts_a_cluster_clients_can_use_and_stops_it(tmp_path):
    root = tmp_path / "cli"
    cmd = [sys.executable, str(LOCALSLURM)]
    started = subprocess.run(
        [*cmd, "start", str(root), "--nodes", "1", "--gpus-per-node", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout == f"export SLURM_CONF={root / 'slurm.conf'}\n"
        sinfo = subprocess.run(
            ["bash", "-c", started.stdout + "sinfo -h -o '%P %D %t'"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert sinfo.stdout.split() == ["debug*", "1", "idle"], sinfo.stderr
        records = json.loads((root / "pids.json").read_text())["processes"]
        pids = [rec["pid"] for rec in records.values()]
    finally:
        stopped = subprocess.run(
            [*cmd, "stop", str(root)], capture_output=True, text=True, timeout=120
        )
    assert stopped.returncode == 0, stopped.stderr
    assert [pid for pid in pids if is_running(pid)] == []


def test_scontrol_job_records_parse_values_that_contain_spaces():
    record = parse_job_record(
        "JobId=7 JobName=a b JobState=PENDING Reason=Resources Dependency=(null) "
        "Command=/x/run me.sh --flag Socks/Node=* ReqB:S:C:T=0:0:*:* WorkDir=/tmp/w x"
    )

    assert record["JobName"] == "a b"
    assert record["Command"] == "/x/run me.sh --flag"
    assert record["Socks/Node"] == "*"
    assert record["ReqB:S:C:T"] == "0:0:*:*"
    assert record["WorkDir"] == "/tmp/w x"


def wait_for_file(path: Path, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
