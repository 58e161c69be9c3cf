"""An experiment's run directory and the config recorded in it, shared by `train` and `launch`.

Imports no torch, so rendering a job script stays light.
"""

from __future__ import annotations

import contextlib
import os

from pyrecover import config as config_mod
from pyrecover.config import Config, ConfigError
from pyrecover.rundir import RunDir, storage_error


def prepare_run_dir(cfg: Config, run: RunDir) -> None:
    """prepare_run_dir creates the run directory and records or checks `run.yaml`.

    A restart whose config changes what the run computes (model, data, seed, global batch) is
    refused; limits such as train.max_steps may change.
    """
    if run.config.is_file():
        try:
            old = config_mod.load(run.config)
        except ConfigError as exc:
            raise ConfigError(f"{run.config} (the run's recorded config): {exc}") from None
        changed = config_mod.diff_identity(old, cfg)
        if changed:
            raise ConfigError(
                f"{run.root} was started with another config ({'; '.join(changed)}); "
                "use a new run.exp_name or --run-dir, or restore the old values")
    run.create()
    if not run.config.is_file():
        write_config(cfg, run)


def write_config(cfg: Config, run: RunDir) -> None:
    """write_config replaces `run.yaml` atomically with the resolved config."""
    tmp = run.config.with_name(f".run.yaml.{os.getpid()}")
    try:
        tmp.write_text(config_mod.dump(cfg))
        os.replace(tmp, run.config)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise storage_error("write", run.config, exc) from None
