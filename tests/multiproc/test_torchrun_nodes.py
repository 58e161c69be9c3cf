"""Two torchrun agents, one per "node" on this host, with `--max-restarts`: a worker that
fails on one node restarts its node's workers with a restart count of 1, while the other
node's workers, still alive, are restarted for the membership change with a count of 0.
Under torch's shared agent store the ranks then met under different keys, and the group
never formed. `pyrecover.elastic_agent` gives each rendezvous round a store of its own.
Real agents (c10d rendezvous), real gloo, a small worker written here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyrecover import elastic_agent, elastic_rdzv, spawn

pytestmark = pytest.mark.multiproc

WORKER = '''
import os, sys, threading
import torch
from pyrecover import dist

marks = sys.argv[1]
first = not os.path.exists(os.path.join(marks, "failed"))  # read before the group forms
env = dist.detect(os.environ)
dist.setup(env, "cpu", timeout_s=30)
torch.distributed.barrier()
with open(os.path.join(marks, f"seen-{os.getpid()}"), "w") as f:
    f.write(f"{first} {env.rank} {env.attempt}")
if first and env.rank == 1:
    open(os.path.join(marks, "failed"), "w").close()
    os._exit(1)  # rank 1's node counts a failure and restarts
if first:
    threading.Event().wait()  # healthy: restarted for the membership change, uncounted
total = torch.tensor([env.rank + 1.0])
torch.distributed.all_reduce(total)
assert total.item() == 3.0, total
dist.teardown()
'''


def _agent(module: str, port: int, worker: Path, marks: Path) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYRECOVER_", "SLURM_", "TORCHELASTIC_", "TORCH_"))}
    prefix = ["-m", module] + (["--stop-signal", "USR2"] if module != "torch.distributed.run"
                               else [])
    return subprocess.Popen(
        [sys.executable, *prefix, "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "nodes", "--max-restarts", "1", "--monitor-interval", "0.2",
         str(worker), str(marks)],
        env={**clean, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)


def test_nodes_whose_restart_counts_differ_still_meet_after_a_restart(tmp_path):
    worker, marks = tmp_path / "worker.py", tmp_path / "marks"
    worker.write_text(WORKER)
    marks.mkdir()
    port = spawn.free_port()
    agents = [_agent("pyrecover.elastic_agent", port, worker, marks) for _ in range(2)]
    try:
        errs = [proc.communicate(timeout=300)[1] for proc in agents]
    finally:
        for proc in agents:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in agents] == [0, 0], "\n".join(e[-2000:] for e in errs)
    seen = sorted(tuple(f.read_text().split()) for f in marks.glob("seen-*"))
    first = [s for s in seen if s[0] == "True"]
    again = [s for s in seen if s[0] == "False"]
    assert len(first) == 2 and len(again) == 2, seen
    # The case itself: after the restart, the two nodes' counts differ (0 and 1).
    assert sorted(s[2] for s in again) == ["0", "1"], seen


def test_a_node_whose_peers_never_join_ends_with_one_line_once_the_rendezvous_times_out():
    """node 1 never comes: node 0's agent, once the rendezvous timed out, printed torch's
    RendezvousTimeoutError traceback. One line instead, and a crash's code (1), which the
    job script restarts or requeues on other nodes."""
    argv = [sys.executable, "-m", "pyrecover.elastic_agent", "--stop-signal", "USR2",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{spawn.free_port()}", "--rdzv-id", "alone",
            "--rdzv-conf", "join_timeout=3", "--max-restarts", "0", "--no-python", "true"]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYRECOVER_", "SLURM_", "TORCHELASTIC_", "TORCH_"))}
    done = subprocess.run(argv, env=clean, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert ("pyrecover: torchrun's rendezvous timed out: the other nodes did not join within "
            "3 s (--nnodes 2)") in done.stderr, done.stderr[-3000:]


def test_a_node_whose_host_never_starts_gives_up_with_one_line_near_its_join_timeout():
    """node 0, which hosts the rendezvous's store, never starts: node 1 waited torch's
    connect timeout twice and a random pause (130 s measured), whatever join_timeout said,
    and then named no cause ("see inner exception"). The wrapper bounds that wait by
    join_timeout (`read_timeout` a third of it). Its length is measured, not asserted."""
    argv = [sys.executable, "-m", "pyrecover.elastic_agent", "--stop-signal", "USR2",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{spawn.free_port()}", "--rdzv-id", "no-host",
            "--rdzv-conf", "is_host=false,join_timeout=15", "--max-restarts", "0",
            "--no-python", "true"]  # is_host=false: node 1, whose host name is not node 0's
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYRECOVER_", "SLURM_", "TORCHELASTIC_", "TORCH_", "PET_"))}
    done = subprocess.run(argv, env=clean, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert ("pyrecover: torchrun's rendezvous failed: this node could not reach its store at "
            "127.0.0.1:") in done.stderr and "(tried twice, 5 s each; --nnodes 2)" in done.stderr, \
        done.stderr[-3000:]


def test_a_ctrl_c_while_the_agent_waits_for_the_other_nodes_is_one_line_exit_130():
    """A Ctrl-C in the rendezvous (before torch's agent has a handler of its own) printed the
    KeyboardInterrupt's traceback through torch's rendezvous code."""
    port = spawn.free_port()
    argv = [sys.executable, "-m", "pyrecover.elastic_agent", "--stop-signal", "USR2",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "waits", "--max-restarts",
            "0", "--no-python", "true"]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYRECOVER_", "SLURM_", "TORCHELASTIC_", "TORCH_"))}
    proc = subprocess.Popen(argv, env=clean, stderr=subprocess.PIPE, text=True)
    try:
        while not _listens(port):  # node 0 hosts the rendezvous store: it waits there now
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and elastic_agent.CTRL_C_BEFORE_WORKERS in err, err[-3000:]


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("args, expected", [
    ([], "600"), (["--rdzv-conf", "join_timeout=30"], "30"),
    (["--rdzv_conf=read_timeout=5,join_timeout=7"], "7"), (["--rdzv-conf", "x=1"], "600"),
])
def test_the_join_timeout_is_read_from_torchruns_rdzv_conf(args, expected):
    assert elastic_rdzv.join_timeout(args) == expected


@pytest.mark.parametrize("args, environ, expected", [
    (["--rdzv-backend", "c10d", "x.py"], {},
     ["--rdzv-conf", "read_timeout=60", "--rdzv-backend", "c10d", "x.py"]),
    (["--rdzv_backend=c10d", "--rdzv-conf", "join_timeout=30", "x.py", "--rdzv-conf"], {},
     ["--rdzv_backend=c10d", "--rdzv-conf", "join_timeout=30", "x.py", "--rdzv-conf"]),
    (["--rdzv-backend=c10d", "--rdzv_conf=a=1", "--rdzv-conf=join_timeout=9", "x.py"], {},
     ["--rdzv-backend=c10d", "--rdzv_conf=a=1", "--rdzv-conf=join_timeout=9,read_timeout=5",
      "x.py"]),
    (["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=90", "x.py"], {},
     ["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=90,read_timeout=30", "x.py"]),
    (["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=9,read_timeout=2", "x.py"], {},
     ["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=9,read_timeout=2", "x.py"]),
    (["--standalone", "x.py"], {}, ["--standalone", "x.py"]),  # (its own store: the host)
    (["--rdzv-backend", "static", "x.py"], {}, ["--rdzv-backend", "static", "x.py"]),
    (["x.py"], {"PET_RDZV_BACKEND": "c10d"}, ["--rdzv-conf", "read_timeout=60", "x.py"]),
    (["--rdzv-backend", "c10d", "x.py"], {"PET_RDZV_CONF": "join_timeout=9"},
     ["--rdzv-backend", "c10d", "x.py"]),  # an argument would replace the environment's
])
def test_the_store_wait_is_bounded_by_join_timeout_unless_read_timeout_is_set(args, environ,
                                                                            expected):
    assert elastic_rdzv.bound_store_wait(args, environ) == expected
