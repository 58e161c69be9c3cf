"""The run's excluded nodes: `bad-nodes` in the run directory, which the job script writes
(a node, the UTC time and the reason on each tab-separated line; slurm/blocks.py) and
`status` reads and clears."""

from __future__ import annotations

from pyrecover.rundir import RunDir


def read_bad_nodes(run: RunDir) -> list[dict[str, str]]:
    """read_bad_nodes lists the run's excluded nodes, first exclusion of each, in file order."""
    try:
        text = run.bad_nodes.read_text(errors="replace")
    except FileNotFoundError:
        return []
    nodes: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        node, _, rest = line.partition("\t")
        when, _, reason = rest.partition("\t")
        if node.strip():
            nodes.setdefault(node.strip(), {"node": node.strip(), "time": when,
                                            "reason": reason})
    return list(nodes.values())


def clear_bad_nodes(run: RunDir) -> list[str]:
    """clear_bad_nodes empties the run's bad-node list; returns the nodes it held. A job
    already requeued keeps the exclusion SLURM holds for it; the next requeue sets it anew."""
    cleared = [n["node"] for n in read_bad_nodes(run)]
    run.bad_nodes.unlink(missing_ok=True)
    return cleared
