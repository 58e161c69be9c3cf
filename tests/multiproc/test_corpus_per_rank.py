"""Every rank trains on the same corpus: ranks that read other data at the same data.path
(a node whose local copy is stale or another file, a relative path read from another folder)
are refused in one line from rank 0, exit 2, before the first step.

Two real ranks in one gloo group, as torchrun starts them (RANK, WORLD_SIZE, MASTER_*), each
in a folder of its own ("its node"), with the relative data.path `corpus.parquet`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import TINY, build_corpus, events

pytestmark = pytest.mark.multiproc


def two_ranks(storage: Path, nodes: list[Path], *extra: str) -> list[tuple[int, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WANDB_MODE="disabled", LOCAL_RANK="0")
    argv = [sys.executable, "-m", "pyrecover", "train", "--config", str(TINY),
            "--set", f"run.storage={storage}", "--set", "run.exp_name=run",
            "--set", "data.path=corpus.parquet", "--set", "train.max_steps=10"]
    for item in extra:
        argv += ["--set", item]
    ranks = [subprocess.Popen(argv, env={**env, "RANK": str(r)}, cwd=nodes[r],
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:  # an event, not a time bound: each rank ends on its own or is killed here
        said = [p.communicate(timeout=240)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    return [(p.returncode, text) for p, text in zip(ranks, said, strict=True)]


@pytest.fixture
def nodes(tmp_path, corpus) -> list[Path]:
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    (nodes[0] / "corpus.parquet").write_bytes(corpus.read_bytes())
    return nodes


def test_ranks_that_read_other_data_at_the_same_path_are_refused_in_one_line(tmp_path, corpus,
                                                                             nodes):
    """They trained, each on its own corpus, without a word: the run's data order was no
    global order, and no checkpoint said so."""
    build_corpus(nodes[1] / "corpus.parquet", max_bytes=100_000)  # fewer tokens
    storage = tmp_path / "storage"
    (r0, said0), (r1, said1) = two_ranks(storage, nodes)
    assert (r0, r1) == (2, 2), (said0, said1)
    assert "Traceback" not in said0 + said1, (said0, said1)
    errors = [line for line in said0.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, said0
    assert errors[0].startswith("error: corpus.parquet holds other data on rank 1 ("), errors
    assert "than on rank 0" in errors[0] and "every rank must read the same corpus" in errors[0]
    assert "error" not in said1, said1  # rank 0 says it once
    run = storage / "run"
    assert not any((run / "checkpoints").iterdir()) if (run / "checkpoints").exists() else True
    assert [e["error"].split(":")[0] for e in events(run, "error")] == ["DataError"]


def test_ranks_whose_copies_hold_the_same_data_train(tmp_path, corpus, nodes):
    (nodes[1] / "corpus.parquet").write_bytes(corpus.read_bytes())
    (r0, said0), (r1, said1) = two_ranks(tmp_path / "storage", nodes)
    assert (r0, r1) == (0, 0), (said0, said1)
    assert "finished at step 10" in said0


def test_the_same_token_count_with_other_text_is_named_as_such(tmp_path, corpus, nodes):
    table = pq.read_table(corpus)
    rows = [row[::-1] for row in table.column("text").to_pylist()]  # each row's bytes, reordered
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", [rows]),
                   nodes[1] / "corpus.parquet")
    (r0, said0), (r1, _) = two_ranks(tmp_path / "storage", nodes)
    assert (r0, r1) == (2, 2), said0
    assert "(the same " in said0 and " tokens, other text)" in said0, said0
