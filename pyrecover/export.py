"""What `pyrecover ckpt export` writes: the model weights of a checkpoint of any mode, for
inference without pyrecover, in one of three formats (FORMATS).

Every output is written under a temporary name next to `--out` and renamed into place, so
`--out` is either absent, what it was before, or complete; an existing folder with anything in
it is never replaced (rename(2) refuses a non-empty folder, and it is checked first). What
`--format` and `--out` can be refused for is said before torch is imported.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pyrecover.checkpoint import store
from pyrecover.checkpoint.listing import outside_checkpoints, under_a_folder
from pyrecover.checkpoint.store import Checkpoint, CheckpointError
from pyrecover.config_checks import short
from pyrecover.rundir import RunDir

if TYPE_CHECKING:
    import torch

FORMATS = {
    "torch": "one file: the model's plain state_dict (torch.load(OUT, weights_only=True))",
    "safetensors": "one file: the same weights as safetensors, the tied head stored once and "
                   "the model config in its metadata",
    "hf": "a folder a Hugging Face transformers GPT2LMHeadModel loads "
          "(config.json, model.safetensors)",
}
HF_CONFIG, HF_WEIGHTS = "config.json", "model.safetensors"
MODEL_META = "pyrecover_model"  # the safetensors metadata key holding the model config (JSON)


def format_for(out: Path, fmt: str | None) -> str:
    """format_for is the --format to write `out` in: as given, else safetensors for a name
    ending in .safetensors and torch otherwise. A torch file named .safetensors (a pickle
    that safetensors cannot open) is refused."""
    named = out.suffix.lower() == ".safetensors"
    if fmt is None:
        return "safetensors" if named else "torch"
    if fmt == "torch" and named:
        raise CheckpointError(f"--out {out} names a safetensors file, but --format torch "
                              "writes a torch pickle; use --format safetensors, or another "
                              "name (model.pt)")
    return fmt


@dataclass(frozen=True)
class Exported:
    ckpt: Checkpoint
    out: Path
    size: int  # bytes written


def export_model(run: RunDir, step: int | None, out: Path, fmt: str = "torch",
                 replace: bool = False) -> Exported:
    """export_model writes the model of the checkpoint of `step` (default: the newest that
    reads) to `out` in format `fmt`; a model `--format hf` cannot express is refused, naming
    what GPT-2 lacks, and nothing is written. An existing file `out` is replaced only with
    `replace` (--force)."""
    if fmt not in FORMATS:
        raise CheckpointError(f"--format {short(fmt)}: expected one of {', '.join(FORMATS)}")
    out = _target(out, run, fmt, replace)
    save_file = _safetensors(fmt) if fmt != "torch" else None
    if step is not None:
        store.step_folder(run, step)  # a step the run lacks: said before torch's import
    from pyrecover import hf
    from pyrecover.checkpoint import tools

    ckpt, (state, model) = tools.first_that_works(run, step, _weights_and_config)
    if fmt == "hf":
        try:
            config = hf.gpt2_config(model, state["wte.weight"].dtype)
            tensors = hf.gpt2_state(state, model)
        except hf.NotExpressible as exc:
            raise CheckpointError(f"--format hf cannot export step {ckpt.step}: {exc}; "
                                  "--format torch or safetensors keeps the model as it is"
                                  ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tools.temporary(out) as tmp:
        if fmt == "torch":
            tools.save_to(state, tmp)  # a failed write keeps its OSError (one line)
        elif fmt == "safetensors":
            save_file(_once(state), tmp, metadata={"format": "pt", MODEL_META: json.dumps(model)})
            _fsync(tmp)
        else:
            tmp.mkdir()
            (tmp / HF_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            save_file(tensors, tmp / HF_WEIGHTS, metadata={"format": "pt"})
            for name in (HF_CONFIG, HF_WEIGHTS):
                _fsync(tmp / name)
            store.fsync_dir(tmp)
    store.fsync_dir(out.parent)
    size = sum(p.stat().st_size for p in out.iterdir()) if out.is_dir() else out.stat().st_size
    return Exported(ckpt, out, size)


def _weights_and_config(ckpt: Checkpoint) -> tuple[dict[str, torch.Tensor], dict]:
    from pyrecover import offline
    from pyrecover.checkpoint import tools

    return tools.model_state(ckpt, offline.build_model), dict(tools.config_of(ckpt)["model"])


def _target(out: Path, run: RunDir, fmt: str, replace: bool) -> Path:
    """_target is `out` made absolute, or a one-line refusal: a path in the run's checkpoints
    folder or over a file of the run, under a file, over an existing file without `replace`,
    or (for a folder format) over anything but an empty folder."""
    out = Path(os.path.abspath(out))
    if not out.name:
        raise CheckpointError(f"--out {out}: name a file or folder to create")
    under_a_folder(out, "--out")
    root, real = run.root.resolve(), out.resolve()
    outside_checkpoints(out, run, "--out")
    if root in real.parents and (out.exists() or out.is_symlink()):
        raise CheckpointError(f"--out {out} would replace {real.relative_to(root)} of the run "
                              "directory; choose a new path")
    if fmt == "hf" and (out.exists() or out.is_symlink()):
        if out.is_symlink() or not out.is_dir():
            raise CheckpointError(f"--out {out} already exists and is not a folder; --format hf "
                                  "writes a folder: choose a new path")
        if any(out.iterdir()):
            raise CheckpointError(f"--out {out} already exists and is not empty; choose a new "
                                  "folder (nothing was written)")
    elif out.is_dir() and not out.is_symlink():
        raise CheckpointError(f"--out {out} is a folder; --format {fmt} writes a file: name "
                              "one, e.g. --out model.pt")
    elif (out.exists() or out.is_symlink()) and not replace:
        raise CheckpointError(f"--out {out} already exists; choose a new path, or --force to "
                              "replace it")
    elif out.exists() and not out.is_symlink() and not stat.S_ISREG(out.stat().st_mode):
        # --force replaces a file; as root, a device such as /dev/null became a regular file
        raise CheckpointError(f"--out {out} is not a regular file (a device, a pipe or a "
                              "socket); --force replaces only a file: choose a new path")
    return out


def _safetensors(fmt: str):
    """_safetensors is `safetensors.torch.save_file` whose failures are OSErrors (a full disk
    is then one line), or one line saying how to install it."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(f"--format {fmt} needs the safetensors package, which is not "
                              "installed: pip install 'pyrecover[hf]'") from None

    def save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
        try:
            save_file(tensors, path, metadata=metadata)
        except SafetensorError as exc:
            text = str(exc).removeprefix("Error while serializing: ")
            code = re.search(r"\(os error (\d+)\)", text)  # Rust's io::Error, as text
            if code is None:
                raise OSError(text) from None
            # OSError(errno, ...) is its subclass: a PermissionError is the user's (exit 2)
            raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None
    return save


def _once(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """_once drops the head when it is the token embedding (safetensors keeps no tensor twice);
    `safetensors.torch.load_model(GPT(cfg), OUT)` ties it again."""
    import torch

    out = {k: v.contiguous() for k, v in state.items()}
    head, wte = out.get("head.weight"), out.get("wte.weight")
    if head is not None and wte is not None and torch.equal(head, wte):
        del out["head.weight"]
    if "wte.weight" in out:
        out["wte.weight"] = out["wte.weight"].clone()  # its own bytes, not the head's too
    return out


def _fsync(path: Path) -> None:
    """_fsync flushes `path` to disk and gives it the permissions a new file gets here:
    safetensors creates its files readable by the owner only, other formats by the umask."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
