"""Shared fixtures. Helpers that start real processes live in tests/helpers.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"


def pytest_collection_modifyitems(config, items):
    """In CI only GPU and apptainer tests may skip; everything else must run."""
    if not IN_CI:
        return
    for item in items:
        if not ({"gpu", "apptainer"} & {m.name for m in item.iter_markers()}):
            item.user_properties.append(("must_run", True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and dict(item.user_properties).get("must_run"):
        report.outcome = "failed"
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped in CI, where only GPU/apptainer tests may skip: {reason}"


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small parquet corpus of real text (Python's stdlib sources), built once per session."""
    from helpers import build_corpus

    return build_corpus(tmp_path_factory.mktemp("corpus") / "stdlib.parquet")
