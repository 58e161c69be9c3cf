"""tests/gpu's own fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def one_compile_cache(tmp_path_factory):
    """Most tests here start CUDA training runs, each a fresh process that compiles the same
    tiny model into its own run's cache: one Inductor cache for the session compiles it once.
    (Even so they ran past 260 s on an H200, a large part of a lent machine's minutes.) A cache
    the caller set wins; the compiled-restart test sets its own."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        yield
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    try:
        yield
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
