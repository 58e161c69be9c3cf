"""`pyrecover ckpt export --format hf|safetensors`: a trained run's checkpoint of every mode
becomes a folder that transformers' GPT2LMHeadModel loads with no pyrecover code and that
computes pyrecover's logits; what GPT-2 cannot express is refused; --out never costs data."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, pyrecover, tiny_args

from pyrecover.model import GPT, GPTConfig

pytest.importorskip("transformers", reason="transformers is in the dev extra")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="in the dev extra")

# Each mode as a run writes it; model.bias=true in one, so both bias mappings are exported.
MODES = {
    "vanilla": (1, ("checkpoint.mode=vanilla", "model.bias=true")),
    "dcp": (2, ("checkpoint.mode=dcp",)),
    "memory": (2, ("checkpoint.mode=memory", "checkpoint.snapshot_interval=1")),
}
STEPS = ("train.max_steps=6", "checkpoint.interval=3")
HOSTILE = "hf out $(touch PWNED); 'q' \"d\""

# Runs in a fresh interpreter where importing pyrecover fails: what a user without it has.
LOAD_WITHOUT_PYRECOVER = """
import sys, torch
class NoPyrecover:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pyrecover":
            raise ModuleNotFoundError("pyrecover is blocked: the export must load without it")
sys.meta_path.insert(0, NoPyrecover())
from transformers import GPT2LMHeadModel
folder, tokens, out = sys.argv[1:]
model, info = GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
problems = {k: sorted(v) for k, v in info.items() if v}
assert not problems, problems
with torch.no_grad():
    torch.save(model.eval()(torch.load(tokens, weights_only=True)).logits, out)
"""

WITHOUT_SAFETENSORS = """
import runpy, sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "safetensors":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Missing())
sys.argv = ["pyrecover", *sys.argv[1:]]
runpy.run_module("pyrecover", run_name="__main__")
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """trained(mode) is the run directory of a 6-step run of that mode (trained once)."""
    storage = tmp_path_factory.mktemp("hfexport")
    made: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in made:
            nproc, extra = MODES[mode]
            args = (["--nproc", str(nproc)] if nproc > 1 else []) + tiny_args(
                storage, corpus, mode, *extra, *STEPS)
            done = pyrecover("train", *args)
            assert done.returncode == 0, done.stderr
            made[mode] = storage / mode
        return made[mode]
    return get


@pytest.fixture
def vanilla_run(trained, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained("vanilla"), run, symlinks=True)
    return run


def export(run: Path, out: Path, fmt: str, *extra: str):
    return pyrecover("ckpt", "export", str(run), "--format", fmt, "--out", str(out), *extra)


def pyrecover_logits(run: Path, weights: Path, tokens: torch.Tensor) -> torch.Tensor:
    cfg = yaml.safe_load((run / "run.yaml").read_text())["model"]
    model = GPT(GPTConfig(**cfg))
    model.load_state_dict(torch.load(weights, weights_only=True))
    with torch.no_grad():
        return model.eval()(tokens)[0]


def tokens_for(vocab: int, block: int) -> torch.Tensor:
    """Real text (bytes, then end of document) and random tokens over the whole vocabulary."""
    text = list(b"def resume(run):\n    return run.latest()\n") + [256]
    text = (text * block)[:block]
    noise = torch.randint(0, vocab, (2, block), generator=torch.Generator().manual_seed(0))
    return torch.cat([torch.tensor([text]), noise])


@pytest.mark.parametrize("mode", [
    "vanilla",
    pytest.param("dcp", marks=pytest.mark.multiproc),
    pytest.param("memory", marks=pytest.mark.multiproc)])
def test_each_modes_export_loads_in_transformers_without_pyrecover_and_gives_its_logits(
        trained, tmp_path, mode):
    run = trained(mode)
    folder = tmp_path / HOSTILE
    done = export(run, folder, "hf")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"exported step 6 ({mode}) as a Hugging Face GPT-2 folder")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "PWNED").exists()
    assert export(run, tmp_path / "m.pt", "torch").returncode == 0

    tokens = tokens_for(320, 64)
    torch.save(tokens, tmp_path / "tokens.pt")
    loaded = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PYRECOVER, str(folder),
                             str(tmp_path / "tokens.pt"), str(tmp_path / "hf-logits.pt")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    theirs = torch.load(tmp_path / "hf-logits.pt", weights_only=True)
    ours = pyrecover_logits(run, tmp_path / "m.pt", tokens)
    torch.testing.assert_close(theirs, ours)  # fp32 tolerances
    assert ours.std() > 0.1  # trained logits, not a constant two models could share

    # --format safetensors: the same weights, the config in the file, the tied head restored.
    done = export(run, tmp_path / "m.safetensors", "safetensors")
    assert done.returncode == 0, done.stderr
    from safetensors import safe_open
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        cfg = json.loads(f.metadata()["pyrecover_model"])
    model = GPT(GPTConfig(**cfg))
    missing, unexpected = safetensors_torch.load_model(model, tmp_path / "m.safetensors")
    assert not missing and not unexpected
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    # The name says the format where --format does not: a torch pickle named .safetensors
    # (what the default used to write) is refused.
    plain = pyrecover("ckpt", "export", str(run), "--out", str(tmp_path / "n.safetensors"))
    assert plain.returncode == 0 and " as safetensors to " in plain.stdout, plain.stderr
    with safe_open(tmp_path / "n.safetensors", "pt") as f:  # (its header's key order varies)
        assert json.loads(f.metadata()["pyrecover_model"]) == cfg
        named = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert named.keys() == set(f.keys()) and all(
            torch.equal(named[k], f.get_tensor(k)) for k in named)
    mixed = export(run, tmp_path / "p.safetensors", "torch")
    assert mixed.returncode == 2 and not (tmp_path / "p.safetensors").exists()
    assert "names a safetensors file, but --format torch writes a torch pickle" in mixed.stderr


def replace_config(run: Path, step: int, change) -> None:
    """replace_config rewrites the model config inside a vanilla checkpoint and fixes the
    manifest, as a checkpoint written by another pyrecover version would read."""
    folder = run / "checkpoints" / f"step-{step}"
    state = torch.load(folder / "state.pt", weights_only=True)
    change(state["config"]["model"])
    torch.save(state, folder / "state.pt")
    data = (folder / "state.pt").read_bytes()
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_model_gpt2_cannot_express_is_refused_in_one_line_and_nothing_is_written(
        vanilla_run, tmp_path):
    replace_config(vanilla_run, 6, lambda m: m.__setitem__("norm", "rms"))
    before = sorted(p.name for p in tmp_path.iterdir())
    done = export(vanilla_run, tmp_path / "hf", "hf")
    assert done.returncode == 2
    assert done.stderr.startswith("error: --format hf cannot export step 6: model.norm='rms' "
                                  "has no Hugging Face GPT-2 equivalent")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no folder, no temporary
    kept = export(vanilla_run, tmp_path / "m.pt", "torch")  # the formats that keep it as it is
    assert kept.returncode == 0 and "exported step 6" in kept.stdout


def test_out_paths_that_would_cost_data_are_refused_and_left_as_they_were(vanilla_run,
                                                                           tmp_path):
    full = tmp_path / "full"
    (full / "notes").mkdir(parents=True)
    (full / "notes" / "keep.txt").write_text("mine")
    done = export(vanilla_run, full, "hf")
    assert done.returncode == 2 and "already exists and is not empty" in done.stderr
    assert [p.name for p in full.iterdir()] == ["notes"]
    assert (full / "notes" / "keep.txt").read_text() == "mine"

    (tmp_path / "file").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "empty-target", target_is_directory=True)
    (tmp_path / "empty-target").mkdir()
    for taken in ("file", "link"):
        done = export(vanilla_run, tmp_path / taken, "hf")
        assert done.returncode == 2 and "already exists and is not a folder" in done.stderr
    assert (tmp_path / "file").read_text() == "mine" and (tmp_path / "link").is_symlink()
    assert not any((tmp_path / "empty-target").iterdir())

    checkpoints = sorted(p.name for p in (vanilla_run / "checkpoints").iterdir())
    inside = export(vanilla_run, vanilla_run / "checkpoints" / "hf", "hf")
    assert inside.returncode == 2 and "inside the run's checkpoints folder" in inside.stderr
    assert sorted(p.name for p in (vanilla_run / "checkpoints").iterdir()) == checkpoints
    recorded = (vanilla_run / "run.yaml").read_text()
    over = export(vanilla_run, vanilla_run / "run.yaml", "torch")
    assert over.returncode == 2 and "would replace run.yaml" in over.stderr
    assert (vanilla_run / "run.yaml").read_text() == recorded

    for fmt in ("hf", "safetensors", "torch"):  # a full disk: one line, no half-written output
        out = tmp_path / f"disk-full-{fmt}"
        done = pyrecover("ckpt", "export", str(vanilla_run), "--format", fmt, "--out", str(out),
                         max_file_bytes=100_000)
        assert done.returncode == 1, done.stderr  # a fault, as a full disk in training is
        assert done.stderr.startswith(f"error: storage: cannot write {out}: ")
        assert "File too large" in done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "empty-target", "file", "full", "link", "run"]

    empty = tmp_path / "empty"
    empty.mkdir()
    done = export(vanilla_run, empty, "hf")  # an empty folder is filled
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in empty.iterdir()) == ["config.json", "model.safetensors"]


def test_an_existing_file_is_replaced_only_with_force_and_a_file_is_no_folder(vanilla_run,
                                                                             tmp_path):
    for fmt in ("torch", "safetensors"):
        mine = tmp_path / f"mine-{fmt}"
        mine.write_text("mine")
        done = export(vanilla_run, mine, fmt)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "already exists; choose a new path, or --force to replace it" in done.stderr
        assert mine.read_text() == "mine"
        done = export(vanilla_run, mine, fmt, "--force")
        assert done.returncode == 0, done.stderr
        assert "exported step" in done.stdout and mine.stat().st_size > 1000

    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    under = export(vanilla_run, blocker / "sub" / "m.pt", "torch")
    assert under.returncode == 2 and under.stderr.count("\n") == 1, under.stderr
    assert f"{blocker} is a file, not a folder" in under.stderr
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    broken = export(vanilla_run, tmp_path / "dangling" / "m.pt", "torch")
    assert broken.returncode == 2 and "dangling is a broken symbolic link" in broken.stderr
    folder = export(vanilla_run, tmp_path, "torch", "--force")
    assert folder.returncode == 2 and "is a folder; --format torch writes a file" in folder.stderr
    assert blocker.read_text() == "mine"
    # --force replaces a file, not a pipe (nor, as root, a device such as /dev/null)
    pipe = tmp_path / "a-pipe"
    os.mkfifo(pipe)
    done = export(vanilla_run, pipe, "torch", "--force")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "is not a regular file (a device, a pipe or a socket)" in done.stderr
    assert stat.S_ISFIFO(pipe.lstat().st_mode)


def test_without_the_safetensors_package_the_export_says_how_to_get_it(vanilla_run, tmp_path):
    for fmt in ("hf", "safetensors"):
        out = tmp_path / f"out-{fmt}"
        done = subprocess.run([sys.executable, "-c", WITHOUT_SAFETENSORS, "ckpt", "export",
                               str(vanilla_run), "--format", fmt, "--out", str(out)], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2
        assert done.stderr == (f"error: --format {fmt} needs the safetensors package, which is "
                               "not installed: pip install 'pyrecover[hf]'\n")
        assert not out.exists()
