"""The cluster profile's escape hatch: `sbatch_extra`, site options pyrecover has no key for.

Each item is one `#SBATCH` line, `--name` or `--name=value` (`--reservation=big`,
`--gres-flags=enforce-binding`). Options pyrecover sets itself are refused, naming what sets
them instead: a second `--time` would silently replace the profile's, and the job script
relies on `--requeue`, `--open-mode` and its log paths.
"""

from __future__ import annotations

import re
from typing import NoReturn

from pyrecover.config import short
from pyrecover.slurm import LaunchError

# Every option render.sbatch_options can write -> what sets it (a test keeps them in step).
SET_BY = {
    "account": "cluster profile key account, option --account",
    "array": "pyrecover sweep launch",
    "chdir": "the run directory",
    "constraint": "cluster profile key constraint, option --constraint",
    "cpus-per-task": "cluster profile key cpus_per_task, option --cpus-per-task",
    "error": "the run directory's logs/",
    "exclusive": "cluster profile key exclusive, option --exclusive",
    "gpus-per-node": "cluster profile key gpus_per_node, option --gpus-per-node",
    "job-name": "experiment key run.exp_name, option --exp-name",
    "mem": "cluster profile key mem, option --mem",
    "no-kill": "cluster profile key spare_nodes, option --spare-nodes",
    "nodes": "cluster profile keys nodes and spare_nodes, options --nodes, --spare-nodes",
    "ntasks-per-node": "cluster profile key gpus_per_node, option --gpus-per-node",
    "open-mode": "the job script: requeued runs append to their log",
    "output": "the run directory's logs/",
    "partition": "cluster profile key partition, option --partition",
    "qos": "cluster profile key qos, option --qos",
    "requeue": "the job script, which requeues itself",
    "signal": "cluster profile key signal_seconds, option --signal-seconds",
    "time": "cluster profile key time, option --time",
}
# Other spellings sbatch takes for the same options.
ALIASES = {"tasks-per-node": "ntasks-per-node", "no-requeue": "requeue", "workdir": "chdir"}
# sbatch reads options with getopt_long, which takes any unambiguous abbreviation (`--tim`
# is `--time`): a proper prefix of a pyrecover option is refused too, except these options
# of sbatch's own.
_OWN_PREFIXES = ("gpus", "ntasks")
_ITEM = re.compile(r"--([a-z][a-z0-9-]*)(?:=(.*))?", re.DOTALL)


def parse(item: str) -> tuple[str, str | None]:
    """parse splits a checked item into its option name and value (None: a flag)."""
    m = _ITEM.fullmatch(item)
    if m is None:
        raise ValueError(f"not an sbatch_extra item: {item!r}")
    return m.group(1), m.group(2)


def check(item: str) -> None:
    """check raises LaunchError (one line) for an item that is malformed, cannot be carried
    by an `#SBATCH` line, or sets an option pyrecover sets itself."""
    m = _ITEM.fullmatch(item)
    if m is None:
        _refuse(item, "expected --name or --name=value, name in lowercase letters, digits "
                "and '-' (cluster profile key sbatch_extra, option --sbatch-extra)")
    name, value = m.group(1), m.group(2) or ""
    # sbatch reads an #SBATCH line one line at a time and a backslash as an escape.
    bad = next((c for c in value if c == "\\" or not c.isprintable()), None)
    if bad is not None:
        _refuse(item, f"an #SBATCH line cannot carry {bad!r}")
    full = name if name in _OWN_PREFIXES else next(
        (o for o in sorted((*SET_BY, *ALIASES)) if o.startswith(name)), name)
    owner = ALIASES.get(full, full)
    if owner in SET_BY:
        what = f"pyrecover sets --{owner}" if owner == name else \
            f"--{name} would change --{owner}, which pyrecover sets"
        _refuse(item, f"{what} itself ({SET_BY[owner]})")


def _refuse(item: str, why: str) -> NoReturn:
    raise LaunchError(f"sbatch_extra {short(item)} is not allowed: {why}")
