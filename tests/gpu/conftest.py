"""tests/gpu's own fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture(autouse=True)
def one_compile_cache(inductor_cache, monkeypatch):
    """Most tests here start CUDA training runs, each a fresh process that compiles the same
    tiny model into its own run's cache: one Inductor cache for the tests in this folder
    compiles it once. (Even so they ran past 260 s on an H200, a large part of a lent
    machine's minutes.) A cache the caller set wins; the compiled-restart test sets its own.
    Set per test, so the tests of other folders in the same session never see it."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
