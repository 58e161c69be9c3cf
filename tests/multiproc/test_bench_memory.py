"""`pyrecover bench memory`: two real ranks, the real trainer, ratios that add up."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, pyrecover

from pyrecover.bench import memory as bench_memory

pytestmark = pytest.mark.multiproc


def test_bench_memory_runs_end_to_end_and_its_json_has_every_figure_and_ratio(tmp_path,
                                                                               corpus):
    done = pyrecover("bench", "memory", "--dir", str(tmp_path), "--size-gb", "0.01",
                     "--repeat", "1", "--config", str(TINY), "--set", f"data.path={corpus}",
                     "--steps", "4", "--warmup", "1", "--json", timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["world_size"] == 2 and report["state_bytes"] > 5e6
    rows = {r["figure"]: r for r in report["rows"]}
    assert set(rows) == set(bench_memory.FIGURES)
    for name, r in rows.items():
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"], name
    med = {name: r["median_s"] for name, r in rows.items()}
    ratios = report["ratios"]
    assert ratios["blocked_vs_torch_save"] == pytest.approx(
        med["snapshot_blocked"] / med["torch_save"])
    assert ratios["persist_parallel_vs_one_writer"] == pytest.approx(
        med["persist_parallel"] / med["persist_one_writer"])
    assert ratios["step_snapshot_vs_step"] == pytest.approx(med["step_snapshot"] / med["step"])
    modes = {r["mode"]: r for r in report["train"]["rows"]}
    assert set(modes) == {"none", "memory"}
    assert ratios["tokens_per_s_vs_none"] == pytest.approx(
        modes["memory"]["tokens_per_s"] / modes["none"]["tokens_per_s"])
    assert modes["memory"]["snapshots"] == 4 and modes["none"]["snapshots"] == 0
    assert set(report["targets"]) == {"blocked_vs_torch_save", "tokens_per_s_vs_none"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("pyrecover-bench-")]
