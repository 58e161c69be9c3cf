"""`pyrecover bench restart` on a real local SLURM cluster, with its smallest settings: one
signal and one crash of a 2-task job of the tiny model.

What is checked is that the report adds up, never how fast anything was: the phases, read
from the trainer's events, span the interruption to the resumed step; the bench's own clock
(which saw that step by reading the events) agrees with them; SLURM's requeue delay lies
inside the gap between one attempt's exit and the next one's start.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import check_restart_cycles

from pyrecover.bench import restart

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SETS = ("model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64",
        "train.global_batch_size=8", "train.micro_batch_size=2", "checkpoint.interval=5")


def test_a_signal_and_a_crash_are_timed_phase_by_phase_and_the_phases_add_up_to_the_total(
        local_slurm, corpus, tmp_path, monkeypatch):
    for key, value in local_slurm.client_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{local_slurm.client_env()['PATH']}")
    notes: list[str] = []
    report = restart.bench_restart(
        tmp_path / "storage", REPO / "launch" / "clusters" / "local.yaml",
        REPO / "launch" / "experiments" / "tiny.yaml", [f"data.path={corpus}", *SETS],
        ["--nodes", "2", "--gpus-per-node", "1", "--launcher", "none"], restart.KINDS, 1,
        None, timeout=240, note=notes.append)
    assert report["world_size"] == 2
    check_restart_cycles(report)
    for cycle in report["cycles"]:
        rows = cycle["rows"]
        # SLURM held the job between the attempts: inside the exit -> next process gap
        # (SLURM's times are whole seconds), and the rest is what is left of the total.
        start_gap = next(r["gap"] for r in rows if r["phase"] == "process_start")
        assert 1 <= cycle["requeue_delay_s"] <= start_gap + 1, cycle
        assert cycle["rest_s"] == pytest.approx(cycle["total_s"] - cycle["requeue_delay_s"])
    for kind, summary in report["summary"].items():
        # A start that failed on its own (another local cluster's job on the same
        # rendezvous port) is reported but left out of the summary.
        clean = [c for c in report["cycles"] if c["kind"] == kind and not c["failed_starts"]]
        assert summary["runs"] == len(clean)
        if clean:
            assert summary["figures"]["rest_s"]["median"] == clean[0]["rest_s"]
        assert summary["target_rest_s"] == restart.TARGETS[kind]
    text = restart.format_restart(report)
    assert "rest (total - delay)" in text and "kill -> survivors exit" in text
