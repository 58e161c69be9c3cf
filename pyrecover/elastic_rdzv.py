"""The rendezvous side of `python -m pyrecover.elastic_agent`: torchrun's options read from
its arguments, and the one line that says why its rendezvous ended a node's agent."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


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


def conf(args: Sequence[str], key: str) -> str | None:
    """conf is the value of `key` in torchrun's `--rdzv-conf k=v,...` in `args`, None where
    it is not set there."""
    for item in (option(args, "rdzv-conf") or "").split(","):
        name, _, value = item.partition("=")
        if name.strip() == key and value.strip():
            return value.strip()
    return None


def join_timeout(args: Sequence[str]) -> str:
    """join_timeout is the seconds torchrun's rendezvous waits for the nodes (`--rdzv-conf
    join_timeout=N`; torch's default 600)."""
    return conf(args, "join_timeout") or "600"


def read_timeout(args: Sequence[str]) -> str:
    """read_timeout is the seconds the c10d rendezvous's store client waits for an answer,
    from node 0's store too when it connects (`--rdzv-conf read_timeout=N`; torch's 60)."""
    return conf(args, "read_timeout") or "60"


def bound_store_wait(args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """bound_store_wait is torchrun's `args` with `read_timeout` in `--rdzv-conf`, a third of
    join_timeout (5 to torch's 60 s), where the rendezvous is c10d's and neither sets one.

    A node whose store host, node 0, never started waits to connect read_timeout, a random
    pause, and read_timeout again (torch's TCPStore; 130 s measured at torch's 60), however
    short join_timeout is; a third of it keeps that wait near join_timeout. A longer one
    than torch's would hold every later store call the longer when node 0 dies mid-run, so
    the default (join_timeout 600) keeps torch's 60. A `--rdzv-conf` that only the
    environment gives (PET_RDZV_CONF) is left alone: the argument would replace it."""
    backend = option(args, "rdzv-backend") or environ.get("PET_RDZV_BACKEND")
    given = option(args, "rdzv-conf")
    if backend != "c10d" or conf(args, "read_timeout") or (
            given is None and "PET_RDZV_CONF" in environ):
        return list(args)
    spellings = ("--rdzv-conf", "--rdzv_conf")
    given_at = [i for i, arg in enumerate(args) if arg.partition("=")[0] in spellings]
    try:
        seconds = min(60, max(5, int(float(join_timeout(args))) // 3))
    except ValueError:  # torch says what is wrong with it
        return list(args)
    if given_at and given is None:  # `--rdzv-conf` last, without its value: torch's error
        return list(args)
    added = f"{given},read_timeout={seconds}" if given else f"read_timeout={seconds}"
    if not given_at:
        return ["--rdzv-conf", added, *args]
    out, i = list(args), given_at[-1]
    if "=" in out[i]:
        out[i] = f"{out[i].partition('=')[0]}={added}"
    else:
        out[i + 1] = added
    return out


def rendezvous_failed(args: Sequence[str], exc: Exception) -> str:
    """rendezvous_failed says in one line why torchrun's rendezvous ended this node's agent
    before any worker started, and what to do."""
    nodes = option(args, "nnodes") or "?"
    if type(exc).__name__ == "RendezvousTimeoutError":
        return (f"pyrecover: torchrun's rendezvous timed out: the other nodes did not join "
                f"within {join_timeout(args)} s (--nnodes {nodes}); see in the job's log "
                "whether their tasks started; a longer wait: --rdzv-conf join_timeout=SECONDS")
    endpoint = option(args, "rdzv-endpoint") or "?"
    if type(exc).__name__ == "RendezvousConnectionError":
        return (f"pyrecover: torchrun's rendezvous failed: this node could not reach its store "
                f"at {endpoint} (tried twice, {read_timeout(args)} s each; --nnodes {nodes}); "
                "see in the job's log whether the node hosting it (node 0) started its task; "
                "a longer wait: --rdzv-conf join_timeout=SECONDS")
    return (f"pyrecover: torchrun's rendezvous failed: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'} (store "
            f"{endpoint}, --nnodes {nodes}); see in the job's log "
            "whether the node hosting it (node 0) started its task")
