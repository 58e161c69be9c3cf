"""The `local_slurm` fixture: one real local SLURM cluster for the whole test session.

It stands up tests/localslurm.py's cluster (2 nodes x 4 CPUs x 4 fake GPUs) in a temporary
directory. Where SLURM cannot be started the slurm tests skip with the reason, except in CI
(CI=true), where that is a failure: CI must run them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for localslurm
from localslurm import LocalSlurm  # noqa: E402


def cannot_run(reason: str) -> None:
    """Fail in CI, skip elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"local SLURM cluster unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"local SLURM cluster unavailable: {reason}")


def started_cluster(root: Path, nodes: int) -> Iterator[LocalSlurm]:
    """A started LocalSlurm of `nodes` nodes x 4 CPUs x 4 fake GPUs, stopped afterwards (a
    fixture's body)."""
    cluster = LocalSlurm(root, nodes=nodes, cpus_per_node=4, gpus_per_node=4)
    try:
        cluster.start()
    except Exception as exc:  # any reason at all: report it, do not crash the session
        cannot_run(f"{type(exc).__name__}: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


def cancelled_after(cluster: LocalSlurm) -> Iterator[list[int]]:
    """Job ids to cancel (for good) when the test ends, so a failed test leaves nothing
    running (a fixture's body)."""
    ids: list[int] = []
    yield ids
    for job_id in ids:
        cluster.cancel(str(job_id))


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """A started LocalSlurm; `local_slurm.env` points sbatch/squeue/scontrol at it."""
    yield from started_cluster(tmp_path_factory.mktemp("slurm"), nodes=2)


@pytest.fixture
def jobs(local_slurm: LocalSlurm) -> Iterator[list[int]]:
    """Job ids to cancel when the test ends, so a failed test leaves nothing running."""
    yield from cancelled_after(local_slurm)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small parquet of Python-like text in a `text` column, in its own folder (the e2e
    tests bind that folder into the container)."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 12 for i in range(60)]
    pq.write_table(pa.table({"text": docs}), folder / "corpus.parquet")
    return folder / "corpus.parquet"
