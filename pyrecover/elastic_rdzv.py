"""The rendezvous side of `python -m pyrecover.elastic_agent`: torchrun's options read from
its arguments, and the one line that says why its rendezvous ended a node's agent."""

from __future__ import annotations

from collections.abc import Sequence


def option(args: Sequence[str], name: str) -> str | None:
    """option is the value of torchrun's option `--name` in `args` (either spelling: `-`
    or `_`, `--name V` or `--name=V`; the last one given), None where it is not there."""
    spellings = {f"--{name}", f"--{name.replace('-', '_')}"}
    value = None
    for i, arg in enumerate(args):
        key, eq, rest = arg.partition("=")
        if key in spellings:
            value = rest if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def join_timeout(args: Sequence[str]) -> str:
    """join_timeout is the seconds torchrun's rendezvous waits for the nodes (`--rdzv-conf
    join_timeout=N`; torch's default 600)."""
    for item in (option(args, "rdzv-conf") or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout" and value.strip():
            return value.strip()
    return "600"


def rendezvous_failed(args: Sequence[str], exc: Exception) -> str:
    """rendezvous_failed says in one line why torchrun's rendezvous ended this node's agent
    before any worker started, and what to do."""
    nodes = option(args, "nnodes") or "?"
    if type(exc).__name__ == "RendezvousTimeoutError":
        return (f"pyrecover: torchrun's rendezvous timed out: the other nodes did not join "
                f"within {join_timeout(args)} s (--nnodes {nodes}); see in the job's log "
                "whether their tasks started; a longer wait: --rdzv-conf join_timeout=SECONDS")
    return (f"pyrecover: torchrun's rendezvous failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'} (store "
            f"{option(args, 'rdzv-endpoint') or '?'}, --nnodes {nodes}); see in the job's log "
            "whether the node hosting it (node 0) started its task")
