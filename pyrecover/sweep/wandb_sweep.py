"""The sweep registered with wandb, so its sweep page lists the trials' runs.

Grid and random: pyrecover stays the controller: the trials and their values are fixed at
launch and run as a SLURM job array. The sweep is registered once, at the first launch,
through wandb's own client (`wandb.sweep`, two GraphQL calls: Viewer and UpsertSweep) with
`controller: {type: local}`, which tells the server that no wandb agent is to be handed runs.
Bayes: registered without it, so wandb's controller hands each trial its run (bayes.py).
Each trial's config gets the sweep's id (`tracking.sweep_id`), and its wandb run, whose id is
kept across requeues, carries it; a run logged offline carries it too, and `wandb sync`
attaches it to the sweep.

Only when `tracking.wandb` resolves to online (a key, and a server that answers): a sweep
launched offline is not registered, and a bayes sweep is refused (`require_online`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.client
import io
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pyrecover import tracking
from pyrecover.config import Config
from pyrecover.sweep import SweepError, WandbUnavailable, record

OURS = ("max_parallel", "seed")
"""pyrecover's own keys of the sweep file: wandb's format has no place for them."""
LOCAL_CONTROLLER = {"type": "local"}
VIEWER = "query Viewer { viewer { id } }"


@dataclass(frozen=True)
class Registered:
    sweep_id: str
    url: str | None


def sweep_config(path: str | Path, name: str) -> dict[str, Any]:
    """sweep_config is what is sent to wandb: the sweep file as written (already checked by
    spec.load), less pyrecover's own keys, with its name and, but for bayes, the local
    controller."""
    raw = yaml.safe_load(Path(path).read_text())
    config = {k: v for k, v in raw.items() if k not in OURS}
    config["name"] = name
    for param in (config.get("parameters") or {}).values():
        for key in ("min", "max", "q"):  # YAML 1.1 reads 1e-3 as a string; wandb wants numbers
            if isinstance(param.get(key), str):
                param[key] = float(param[key])
    if raw.get("method") != "bayes":
        config["controller"] = dict(LOCAL_CONTROLLER)
    return config


def require_online(setting: str, environ: Mapping[str, str]) -> None:
    """require_online refuses a bayes sweep in one line unless tracking.wandb resolves to
    online with an API key (SweepError) and the server answers (WandbUnavailable): wandb's
    controller chooses every trial's values."""
    url = tracking.base_url(environ)
    mode = tracking.resolve_mode(setting, environ, reachable=lambda _: True)  # asked below
    if not tracking.api_key_configured(environ):
        why = "no API key"
    elif mode != "online":
        why = f"tracking.wandb={setting} resolves to {mode}"
    elif not tracking.server_reachable(url):
        raise WandbUnavailable(unanswered(url, "a bayes sweep cannot be launched: wandb's "
                                          "controller chooses each trial's values"))
    else:
        return
    raise SweepError(f"method=bayes needs tracking.wandb online with an API key ({why}): "
                     "wandb's controller chooses each trial's values; set WANDB_API_KEY (or "
                     "`wandb login`) and tracking.wandb=online, or use grid or random")


def unanswered(url: str, why: str) -> str:
    """unanswered is the one line of a wandb server that does not answer (WandbUnavailable)."""
    return f"wandb's server {url} does not answer from here, so {why}; launch again once it " \
        "answers"


def register(config: dict[str, Any], project: str, entity: str | None,
             environ: Mapping[str, str]) -> Registered:
    """register creates the sweep on the wandb server and returns its id; raises SweepError
    in one line when wandb refuses it (a wrong key), WandbUnavailable when the server fails."""
    try:
        import wandb
    except ImportError as exc:
        raise SweepError(f"tracking.wandb is online but wandb is not importable ({exc}); "
                         "install it or set tracking.wandb=offline") from None
    said = io.StringIO()  # wandb.sweep prints its id and URL; the CLI says it in its own words
    # wandb.sweep sets WANDB_PROJECT, WANDB_ENTITY and the address of its service process in
    # os.environ, which sbatch would hand to every trial (whose wandb then dials a service
    # that has exited): the environment is put back and the service stopped.
    environ = dict(os.environ)
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(io.StringIO()):
            sweep_id = wandb.sweep(config, entity=entity or None, project=project)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        url = tracking.base_url(environ)
        failing = server_failing(url, tracking.api_key(environ))
        if failing:
            raise WandbUnavailable(f"wandb did not register the sweep: its server {url} "
                                   f"{failing}, a fault of the server, not of the key; launch "
                                   "again once it works, or set tracking.wandb=offline to "
                                   "launch without it") from None
        raise SweepError(f"wandb did not register the sweep ({type(exc).__name__}: {first}); "
                         "fix the key or server, or set tracking.wandb=offline to launch "
                         "without it") from None
    finally:  # quiet too: wandb's finalizer thread may fail on a refused server as it stops
        with contextlib.suppress(Exception), contextlib.redirect_stderr(io.StringIO()):
            wandb.teardown()
        os.environ.clear()
        os.environ.update(environ)
    url = re.search(r"^Sweep URL: (\S+)", said.getvalue(), re.M)
    return Registered(str(sweep_id), url.group(1) if url else None)


def server_failing(url: str, key: str | None, timeout_s: float = 10.0) -> str | None:
    """server_failing asks the server once, with the key, who it belongs to (wandb's Viewer
    query), after wandb failed: wandb raises the same error for a key the server refuses as
    for a server that fails. Returns what the server did wrong (an HTTP 5xx, 408 or 429, no
    answer) or None where it answered, refusing the key (401, 403) or not."""
    request = urllib.request.Request(
        url.rstrip("/") + "/graphql", data=json.dumps({"query": VIEWER}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Basic " + base64.
                 b64encode(f"api:{key or ''}".encode()).decode()})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        return f"answers HTTP {exc.code}" if exc.code >= 500 or exc.code in (408, 429) else None
    except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError, a timeout
        return f"does not answer ({getattr(exc, 'reason', exc) or type(exc).__name__})"


def attach(sweep_file: Path, sweep_dir: Path, rec: record.Record, cfgs: list[Config],
           environ: Mapping[str, str]) -> tuple[record.Record, list[Config]]:
    """attach gives the record and each trial's config the sweep's wandb id: the one recorded
    at the first launch (a relaunch registers nothing); else, where tracking.wandb resolves
    to online, a new registration; else none, and nothing changes."""
    base = cfgs[0].tracking
    url = tracking.base_url(environ)
    if (sweep_dir / record.RECORD).is_file():
        known = record.read(sweep_dir).wandb
    elif base.wandb == "online" and not tracking.server_reachable(url):
        # A trial falls back to offline; the sweep cannot: a relaunch never registers it.
        raise WandbUnavailable(unanswered(url, "the sweep cannot be registered "
                                          "(tracking.wandb=online; a relaunch would not "
                                          "register it later)") + ", or set "
                               "tracking.wandb=offline")
    elif tracking.resolve_mode(base.wandb, environ) == "online":
        done = register(sweep_config(sweep_file, rec.name), base.project, base.entity,
                        environ)
        known = {"sweep_id": done.sweep_id, "url": done.url}
    else:
        known = None
    if not known:
        return rec, cfgs
    return dataclasses.replace(rec, wandb=known), [
        dataclasses.replace(c, tracking=dataclasses.replace(
            c.tracking, sweep_id=c.tracking.sweep_id or known["sweep_id"])) for c in cfgs]
