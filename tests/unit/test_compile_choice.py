"""`train.compile`: where it compiles, and what happens on a machine without a C compiler
(torch.compile's kernels need one at run time; the CUDA runtime images have none)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pyrecover import config
from pyrecover.compiling import compile_enabled

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("setting,device,expected", [
    ("auto", CUDA, True), ("auto", CPU, False), ("true", CPU, True), ("false", CUDA, False)])
def test_compile_follows_the_setting_and_the_device(setting, device, expected, monkeypatch):
    monkeypatch.setenv("CC", "sh")  # any program on PATH stands for the compiler
    cfg = config.load(None, [f"train.compile={setting}"])
    assert compile_enabled(cfg, device) is expected


def test_without_a_c_compiler_auto_trains_eager_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    cfg = config.load(None, ["train.compile=auto"])
    logger = logging.getLogger("test-compile")
    with caplog.at_level(logging.WARNING, logger="test-compile"):
        assert compile_enabled(cfg, CUDA, logger) is False
    assert "no C compiler" in caplog.text
    with pytest.raises(config.ConfigError, match="train.compile=true needs a C compiler"):
        compile_enabled(config.load(None, ["train.compile=true"]), CUDA)


def test_the_compile_cache_is_the_runs_unless_the_user_chose_one(tmp_path):
    from pyrecover.compiling import CACHE_ENV, use_cache

    environ: dict[str, str] = {}
    assert use_cache(tmp_path / "run" / "compile-cache", environ) == tmp_path / "run" / \
        "compile-cache"
    assert environ[CACHE_ENV] == str(tmp_path / "run" / "compile-cache")
    mine = {CACHE_ENV: "/scratch/me/inductor"}
    assert use_cache(tmp_path / "run" / "compile-cache", mine) == tmp_path.root / Path(
        "scratch/me/inductor")
    assert mine == {CACHE_ENV: "/scratch/me/inductor"}
