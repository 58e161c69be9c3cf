"""Experiment tracking: one wandb run per run directory, on rank 0 only, across every requeue.

The wandb run id is made on the first start and kept in `<run dir>/wandb/run-id`; every
restart initialises wandb with that id and `resume="allow"`, and logs with `step=` equal to the
global training step. Steps that an earlier start already logged (the work a kill threw away
and this start redoes) are not logged again, so a run's curves never go backwards; after a
SIGKILL, "logged" is what the killed start's wandb wrote (pyrecover.wandb_log), so the steps it
lost are logged by the start that redoes them. In offline
mode each start writes its own `wandb/offline-run-<time>-<id>/` folder, all with the same id,
and `wandb sync <run dir>/wandb` uploads them, in start order, as one continuous run.

Tracking never stops training: other ranks get a disabled tracker, and a wandb that fails to
start, or whose service dies mid-run, is reported in one warning and training goes on
without it. The API key is never read
into a log line. Imports neither torch nor wandb until a run is started.
"""

from __future__ import annotations

import contextlib
import json
import logging
import netrc
import os
import secrets
import socket
import string
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pyrecover import config as config_mod
from pyrecover import wandb_log
from pyrecover.config import Config
from pyrecover.ledger import ledger
from pyrecover.records import well_formed
from pyrecover.rundir import RunDir, read_jsonl, replace_text

log = logging.getLogger("pyrecover")

RUN_ID_FILE = "run-id"
SWEEP_PARAMS = "sweep-params.yaml"  # a bayes trial's values from wandb (pyrecover.sweep.bayes)
# Events that explain a restart; a restart with none of them before it was a hard kill
# (SIGKILL, node failure, OOM killer): nothing got the chance to write anything. `requeue`
# follows a stop or a crash, so it names the cause only when nothing else did.
STOP_EVENTS = ("crash", "error", "stop", "signal", "finish")
FINISH_TIMEOUT_S = 60.0  # online: give up the upload at exit; `wandb sync` sends the rest


def api_key_configured(environ: Mapping[str, str], netrc_file: str | None = None) -> bool:
    """api_key_configured tells whether wandb has a key: WANDB_API_KEY or a netrc entry."""
    return api_key(environ, netrc_file) is not None


def api_key(environ: Mapping[str, str], netrc_file: str | None = None) -> str | None:
    """api_key is the key wandb would use, WANDB_API_KEY or the netrc entry for its server's
    host (the entry's password), or None."""
    if environ.get("WANDB_API_KEY"):
        return environ["WANDB_API_KEY"]
    host = urlparse(base_url(environ)).hostname or ""
    path = netrc_file or environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry is not None else None


def server_reachable(url: str, timeout_s: float = 3.0) -> bool:
    """server_reachable tries one TCP connection to the wandb server (a compute node often
    has no route out; finding that out must not cost wandb's 60-second init timeout)."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def resolve_mode(setting: str, environ: Mapping[str, str], netrc_file: str | None = None,
                 reachable: Callable[[str], bool] = server_reachable) -> str:
    """resolve_mode turns `tracking.wandb` into online, offline or disabled.

    An explicit setting wins (`online` falls back to offline when the server does not
    answer). `auto` follows WANDB_MODE when it is set, else goes online only
    when an API key is configured and the server answers, so nothing waits on a network.
    """
    if setting == "online" and not reachable(base_url(environ)):
        # wandb would wait 60 s for it at every start, then leave its run id taken.
        log.warning("wandb: %s is not reachable from here; logging offline (upload later "
                    "with wandb sync)", base_url(environ))
        return "offline"
    if setting != "auto":
        return setting
    env_mode = environ.get("WANDB_MODE", "").strip().lower()
    if env_mode in ("online", "offline", "disabled"):
        return env_mode
    if env_mode == "dryrun":
        return "offline"
    if not api_key_configured(environ, netrc_file):
        return "offline"
    if not reachable(base_url(environ)):
        log.info("wandb: %s is not reachable from here; logging offline", base_url(environ))
        return "offline"
    return "online"


def base_url(environ: Mapping[str, str]) -> str:
    """base_url is the wandb server this environment names (WANDB_BASE_URL), else wandb's."""
    return environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def run_id(run: RunDir) -> str:
    """run_id returns the run directory's wandb id, creating it on the first call."""
    path = run.wandb / RUN_ID_FILE
    if path.is_file():
        text = path.read_text().strip()
        if text:
            return text
    run.wandb.mkdir(parents=True, exist_ok=True)
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
    replace_text(path, new + "\n")
    return new


def restarts(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """restarts lists each resume with its cause: the first stop-like event before it.

    A cause is `crash`, `error`, `stop`, `signal`, `requeue`, `continued` (a finished run
    whose train.max_steps was raised) or `killed` (nothing was recorded: SIGKILL, node loss).
    """
    out: list[dict[str, Any]] = []
    cause = None
    for e in events:
        kind = e.get("event")
        if kind in STOP_EVENTS and cause in (None, "requeue"):
            cause = "continued" if kind == "finish" else kind
        elif kind == "requeue" and cause is None:
            cause = "requeue"
        elif kind == "start":
            cause = None
        elif kind == "resume":
            out.append({"step": int(e.get("step", 0)), "cause": cause or "killed",
                        "steps_lost": int(e.get("steps_lost", 0)),
                        "restore_s": float(e.get("restore_seconds", 0.0))})
            cause = None
    return out


def event_metrics(event: Mapping[str, Any]) -> dict[str, float]:
    """event_metrics turns one events.jsonl record into wandb metrics ({} for the rest)."""
    kind = event.get("event")
    if kind == "checkpoint":
        return {"checkpoint/step": event.get("step", 0),
                "checkpoint/stall_s": event.get("blocked", 0.0),
                "checkpoint/save_s": event.get("seconds", 0.0),
                "checkpoint/mb": round(event.get("bytes", 0) / 1e6, 3)}
    if kind == "checkpoint_failed":
        return {"checkpoint/failed_step": event.get("step", 0)}
    if kind == "bad_step":
        return {"bad_step": event.get("step", 0)}
    return {}


def _teardown() -> None:
    """_teardown stops this process's wandb service. One that ended badly (killed with the
    job step) makes teardown sys.exit: that must not turn a saved stop (75) or a finished run
    into its exit code."""
    with contextlib.suppress(Exception, SystemExit):
        import wandb

        wandb.teardown()


class Tracker:
    """Rank 0's wandb run, or nothing: every method is a no-op when tracking is off."""

    def __init__(self, wb_run: Any = None, run: RunDir | None = None, floor: int = 0,
                 pending: Mapping[str, Any] | None = None) -> None:
        self._wb = wb_run
        self._run = run
        self._events = run.events if run is not None else None
        self._floor = floor  # steps up to here were logged by an earlier start
        self._pending = dict(pending or {})
        self._offset = 0
        if self._wb is not None and self._events is not None and self._events.is_file():
            self._offset = self._events.stat().st_size

    @property
    def enabled(self) -> bool:
        return self._wb is not None

    @property
    def run_id(self) -> str | None:
        return self._wb.id if self._wb is not None else None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """log sends metrics at the global training `step`; steps already logged are skipped."""
        if self._wb is None or step <= self._floor:
            return
        data = {k: v for k, v in metrics.items() if k not in ("step", "time")}
        if self._pending:
            data = {**self._pending, **data}
            self._pending.clear()
        try:
            self._wb.log(data, step=step)
        except Exception as exc:  # its service died (crashed, OOM-killed): not the run's end
            self._wb = None
            _teardown()  # (a later wandb.init in this process would reach for the dead one)
            where = self._run.wandb if self._run is not None else "wandb/"
            log.warning("wandb stopped working at step %d (%s): training goes on without it; "
                        "what it wrote before is in %s (upload it with: wandb sync %s)", step,
                        exc or type(exc).__name__, where, where)

    def after_step(self, step: int) -> None:
        """after_step logs what events.jsonl gained since the last call (checkpoints, ...)."""
        if self._wb is None or self._events is None:
            return
        metrics: dict[str, Any] = {}
        for event in self._new_events():
            metrics.update(event_metrics(event))
        if metrics and step <= self._floor:
            self._pending.update(metrics)  # shown with the first step this start may log
        elif metrics:
            self.log(step, metrics)

    def _new_events(self) -> list[dict[str, Any]]:
        assert self._events is not None
        try:
            if self._events.stat().st_size <= self._offset:
                return []
            with self._events.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits
        self._offset += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # (nested too deeply to parse)
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    def finish(self, exit_code: int = 0) -> None:
        """finish closes the wandb run (marking it failed for a non-zero exit code)."""
        if self._wb is None:
            return
        wb, self._wb = self._wb, None
        if self._run is not None:
            with contextlib.suppress(Exception):  # a summary is a nicety; never a reason to stop
                # The ledger with this attempt in it (at the start it held the ones before),
                # its finish or stop too: the trainer records them before this close.
                wb.summary["ledger"] = ledger(self._run.read_events(),
                                              self._run.read_metrics()).to_dict()
        try:
            if self._pending:
                wb.summary.update(self._pending)
            wb.finish(exit_code=exit_code)
        except Exception as exc:  # tracking must not turn a finished run into a failed one
            log.warning("wandb did not close cleanly: %s", exc)
        # finish() returns before wandb's service has written the run's last records (its
        # stream closes after an asynchronous `inform_finish`), and a trainer ends with
        # os._exit, which skips wandb's atexit teardown: stop the service here, so the
        # transaction log is whole when the run's process ends (`wandb sync` right after).
        _teardown()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from pyrecover.preempt import StopRequested  # a stop to be resumed is not a failure

        clean = exc_type is None or issubclass(exc_type, StopRequested)
        self.finish(exit_code=0 if clean else 1)


def start(cfg: Config, run: RunDir, rank: int, system: Mapping[str, Any] | None = None,
          environ: Mapping[str, str] = os.environ) -> Tracker:
    """start opens (or resumes) the run directory's wandb run on rank 0; others get a no-op.

    Call it after the resume decision is recorded in events.jsonl: the restarts, their causes
    and the lost steps are read from there.
    """
    mode = resolve_mode(cfg.tracking.wandb, environ)
    if rank != 0 or mode == "disabled":
        return Tracker()
    events = well_formed(read_jsonl(run.events), needs_time=True)[0]  # a foreign line is
    metrics = well_formed(read_jsonl(run.metrics), needs_time=False)[0]  # left out (records)
    history = restarts(events)
    floor = max((int(m.get("step", 0)) for m in metrics), default=0)
    if history:
        floor = max(floor, history[-1]["step"])
        if history[-1]["cause"] == "killed":
            floor = _written_floor(run, history[-1]["step"], floor)
    pending: dict[str, Any] = {}
    if history:
        last = history[-1]
        pending = {"restart/count": len(history), "restart/steps_lost": last["steps_lost"],
                   "restart/steps_lost_total": sum(r["steps_lost"] for r in history),
                   "restart/restore_s": last["restore_s"], "restart/from_step": last["step"]}
        for cause in sorted({r["cause"] for r in history}):
            pending[f"restart/cause_{cause}"] = sum(r["cause"] == cause for r in history)
    wb = _init_wandb(cfg, run, mode, system or {})
    if wb is None:
        return Tracker()
    with contextlib.suppress(Exception):  # a summary is a nicety; never a reason to stop
        wb.summary["restarts"] = len(history)
        wb.summary["interruptions"] = history
        wb.summary["ledger"] = ledger(events, metrics).to_dict()
    offline = mode == "offline"
    with contextlib.suppress(Exception):
        offline = offline or bool(wb.offline)  # online that could not start fell back
    where = f"{run.wandb} (offline; upload with: wandb sync {run.wandb})" if offline \
        else wb.url or "wandb"
    log.info("wandb run %s %s: %s", wb.id, "resumed" if history else "started", where)
    return Tracker(wb, run, floor, pending)


def _written_floor(run: RunDir, resumed_at: int, logged: int) -> int:
    """_written_floor is the last step a killed start's wandb wrote (its transaction log),
    between the step this start resumes from and the last one metrics.jsonl holds: wandb had
    no chance to write what it still held, and this start redoes those steps, so it logs them
    again. No log (wandb was off, or never started) reads as the resume step."""
    path = run.wandb / RUN_ID_FILE
    ident = path.read_text().strip() if path.is_file() else ""
    found = wandb_log.newest_log(run.wandb, ident) if ident else None
    written = wandb_log.last_history_step(found) if found is not None else None
    return min(logged, max(resumed_at, written if written is not None else resumed_at))


def _init_wandb(cfg: Config, run: RunDir, mode: str, system: Mapping[str, Any]) -> Any:
    os.environ.setdefault("WANDB_SILENT", "true")
    if (run.wandb / SWEEP_PARAMS).is_file():  # the run's config, as wandb's agent gives it
        os.environ["WANDB_SWEEP_PARAM_PATH"] = str(run.wandb / SWEEP_PARAMS)
    try:
        import wandb
    except ImportError as exc:
        log.warning("wandb is not importable (%s); training goes on without tracking", exc)
        return None
    t = cfg.tracking
    ident = run_id(run)
    kwargs = dict(
        project=t.project, entity=t.entity or None, group=t.group or None,
        name=t.name or cfg.run.exp_name, id=ident, resume="allow", dir=str(run.root),
        tags=[tag.strip() for tag in t.tags.split(",") if tag.strip()] or None,
    )
    tries = [mode] if mode == "offline" else [mode, "offline"]
    for attempt in tries:
        settings = wandb.Settings(
            quiet=True, silent=True, console="off", disable_git=True, save_code=False,
            # The sweep as a run setting: from the environment (WANDB_SWEEP_ID, as an agent
            # sets it) wandb.init would drop our run id, and a requeue would start a new run.
            init_timeout=60.0, sweep_id=t.sweep_id or None,
            finish_timeout=FINISH_TIMEOUT_S if attempt == "online" else 0.0)
        try:
            wb = wandb.init(mode=attempt, settings=settings, **kwargs)
            wb.config.update({"config": config_mod.to_dict(cfg), "system": dict(system)},
                             allow_val_change=True)
            return wb
        except Exception as exc:  # network, auth, a full disk: none of them stops training
            log.warning("wandb %s could not start (%s: %s)%s", attempt, type(exc).__name__,
                        exc, "; trying offline" if attempt != tries[-1] else
                        "; training goes on without tracking")
            # A failed init keeps the run id registered in this process ("run ID ... is in
            # use" for the offline try); tearing wandb down frees it.
            with contextlib.suppress(Exception):
                wandb.teardown()
    return None
