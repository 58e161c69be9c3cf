"""The copy's background thread (checkpoint/staging.py) on the CPU stays out of OpenMP's thread
teams. A torch copy in a second thread gave that thread a team of its own; libgomp, with more
of its threads than cores, then stopped spin-waiting in every team, and on 2 cores each small
op of the loop paid a futex wake-up: memory mode's tiny-model steps took 35 ms instead of 13,
with nothing blocked and no snapshot taken."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, torch
from pyrecover.checkpoint.staging import Copier
torch.set_num_threads(2)
a = torch.ones(1 << 22)
(a * 2).sum()  # the loop's thread has its team
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
copier = Copier(torch.device("cpu"))
target = torch.empty_like(a)
copier.start([target], [a]).result()
assert torch.equal(target, a)
print(threads() - before, torch.get_num_threads())
"""


def test_a_background_copy_adds_its_own_thread_and_no_openmp_team():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    added, loop_threads = map(int, done.stdout.split())
    assert added == 1, f"the copy added {added} threads: its own and an OpenMP team's"
    assert loop_threads == 2  # the loop's own count is left as it was
