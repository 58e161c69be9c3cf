"""wandb's agent protocol, through wandb's own client: how a bayes trial gets its run.

wandb's agent (`wandb agent`, wandb/wandb_agent.py) registers with the sweep (mutation
CreateAgent), then sends heartbeats (mutation Heartbeat); the sweep's controller on the server
answers a heartbeat with commands, one of them `{"type": "run", "run_id": ..., "args":
{"train.lr": {"value": 0.001}}}`. A trial does the same, once, for one run: `ask` registers an
agent for the trial and heartbeats until a run command comes, and returns it. An `exit`
command (the sweep hands out no more runs) ends it; the other commands (stop, resume) concern
runs an agent started itself and are not used here: the trial's own wandb run, under the
run id it was handed, reports to the controller.

Both calls are the ones wandb's agent makes (`wandb.apis.public.sweeps._register_agent` and
`_agent_heartbeat`, wandb 0.31); wandb's heartbeat returns no command where the request
failed, so a server that keeps failing is a run that never comes: AgentUnavailable after
`wait_s`. Imports wandb only when asked.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyrecover.sweep import SweepError

WAIT_S = 300.0
"""How long a trial waits for wandb to hand it a run before it gives up (and requeues)."""
POLL_S = 5.0
"""Between two heartbeats without a run, as wandb's agent does."""


class AgentUnavailable(RuntimeError):
    """wandb could not be asked for a run (network, key, server): a fault, not a mistake in
    the sweep. The trial exits 1, and its job requeues it while restarts remain."""


@dataclass(frozen=True)
class Run:
    run_id: str
    args: dict[str, Any]
    """As the heartbeat carries them: {config key: {"value": v}}."""


def ask(sweep_id: str, project: str, entity: str | None, host: str, wait_s: float = WAIT_S,
        poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep) -> Run:
    """ask registers an agent named `host` with the sweep and returns the first run wandb's
    controller hands it; raises SweepError when the sweep hands out no more runs and
    AgentUnavailable when wandb cannot be asked or hands out nothing within `wait_s`."""
    try:
        import wandb
        from wandb.apis.public.sweeps import _agent_heartbeat, _register_agent
    except ImportError as exc:
        raise AgentUnavailable(f"a bayes trial asks wandb for its values, but wandb's client "
                               f"is not importable here ({exc})") from None
    environ = dict(os.environ)  # wandb's client sets variables of its own; put them back
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            api = wandb.Api(overrides={"project": project, "entity": entity or None})
            agent = _register_agent(api, host, sweep_id=sweep_id, project=project,
                                    entity=entity or None)
            deadline = time.monotonic() + wait_s
            while True:
                for command in _agent_heartbeat(api, agent["id"], {}, {}) or []:
                    run = _command(command, sweep_id)
                    if run is not None:
                        return run
                if time.monotonic() >= deadline:
                    raise AgentUnavailable(f"wandb's sweep {sweep_id} handed out no run in "
                                           f"{wait_s:.0f} s")
                sleep(poll_s)
    except (SweepError, AgentUnavailable):
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise AgentUnavailable(f"wandb did not hand out a run of sweep {sweep_id} "
                               f"({type(exc).__name__}: {first})") from None
    finally:  # quiet too: wandb's finalizer thread may fail on a refused server as it stops
        with contextlib.suppress(Exception), contextlib.redirect_stderr(io.StringIO()):
            wandb.teardown()
        os.environ.clear()
        os.environ.update(environ)


def _command(command: Any, sweep_id: str) -> Run | None:
    """_command is the run a heartbeat's command hands out, or None for any other command."""
    if not isinstance(command, dict):
        return None
    if command.get("type") == "exit":
        raise SweepError(f"wandb's sweep {sweep_id} hands out no more runs (finished, stopped "
                         "or run_cap reached); this trial has no values to train with")
    if command.get("type") != "run":
        return None
    run_id, args = command.get("run_id"), command.get("args")
    if not isinstance(run_id, str) or not isinstance(args, dict):
        raise SweepError(f"wandb's sweep {sweep_id} handed out a run without run_id and args: "
                         f"{str(command)[:200]}")
    return Run(run_id, args)
