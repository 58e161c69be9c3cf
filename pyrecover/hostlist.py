"""SLURM's compact lists, read: `gpu[001-003,010],login1` into host names, `4(x2),3` into
task counts. Pure.
"""

from __future__ import annotations

import re


class DistError(ValueError):
    """The environment describes an impossible layout (bad nodelist, rank >= world size, ...)."""


def expand_hostlist(hostlist: str) -> list[str]:
    """expand_hostlist turns `gpu[001-003,010],login1` into its host names, in order.

    Zero padding follows the lower bound (`[001-010]` gives `001` ... `010`), as SLURM does.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(item))
    if not hosts:
        raise DistError(f"empty SLURM nodelist {hostlist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DistError(f"unbalanced ']' in SLURM nodelist {text!r}")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise DistError(f"unbalanced '[' in SLURM nodelist {text!r}")
    parts.append(current)
    return [p for p in parts if p]


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[: match.start()], item[match.end():]
    out = []
    for rng in match.group(1).split(","):
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise DistError(f"bad range {rng!r} in SLURM nodelist {item!r}")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}"))
    return out


def expand_tasks_per_node(spec: str) -> list[int]:
    """expand_tasks_per_node turns SLURM's `4(x2),3` into `[4, 4, 3]`."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise DistError(f"bad SLURM tasks-per-node value {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
