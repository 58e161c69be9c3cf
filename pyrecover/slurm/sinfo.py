"""A starting cluster profile from what `sinfo` says: pure parsing and rendering.

`pyrecover launch --init-cluster PATH` runs `sinfo -h -o SINFO_FORMAT` (pyrecover.slurm.query)
and passes its output here; without SLURM it passes None and gets the commented defaults.
Only `init_profile` touches the filesystem.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from pyrecover.slurm import LaunchError
from pyrecover.slurm.profile import ClusterProfile, load_profile

SINFO_FORMAT = "%P|%G|%l|%c|%D"  # partition (default marked *), gres, time limit, CPUs, nodes
_GPUS = re.compile(r"gpu(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class NodeType:
    gpus: int
    cpus: int
    nodes: int


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    types: tuple[NodeType, ...]
    """Its node configurations (one sinfo line each, merged where GPUs and CPUs agree): those
    with GPUs first, the most common of them first, then the one with more GPUs."""
    time_limit: str
    """As sinfo prints it: `infinite`, `1-00:00:00`, `30:00`."""

    @property
    def main(self) -> NodeType:
        """main is the node type a starting profile is written for: the one with GPUs that
        most of the partition's nodes are, so `--nodes N` finds N of them (the largest nodes
        of a mixed partition may be too few to start a job at all)."""
        return self.types[0]

    @property
    def gpus_per_node(self) -> int:
        return self.main.gpus

    @property
    def nodes(self) -> int:
        return sum(t.nodes for t in self.types)


def parse_sinfo(text: str) -> list[Partition]:
    """parse_sinfo reads SINFO_FORMAT lines into one Partition each, merging the lines sinfo
    prints per node configuration; the order is sinfo's."""
    seen: dict[str, tuple[bool, str, dict[tuple[int, int], int]]] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5 or not fields[0]:
            continue
        raw, gres, limit, cpus, nodes = fields
        name = raw.rstrip("*")
        gpus = max((int(n) for n in _GPUS.findall(gres)), default=0)
        default, first_limit, counts = seen.get(name, (False, limit, {}))
        key = (gpus, _number(cpus))
        counts[key] = counts.get(key, 0) + _number(nodes)
        seen[name] = (default or raw.endswith("*"), first_limit, counts)
    return [Partition(name, default, tuple(sorted(
        (NodeType(g, c, n) for (g, c), n in counts.items()),
        key=lambda t: (t.gpus == 0, -t.nodes, -t.gpus, -t.cpus))), limit)
        for name, (default, limit, counts) in seen.items()]


def pick(partitions: list[Partition]) -> Partition | None:
    """pick is the partition a job goes to: the default one with GPUs, else any with GPUs,
    else the default, else the first."""
    ranked = sorted(partitions, key=lambda p: (p.gpus_per_node == 0, not p.default))
    return ranked[0] if ranked else None


def fit_problem(partitions: list[Partition], partition: str | None, nodes: int,
                gpus_per_node: int, spare: bool = True) -> str | None:
    """fit_problem says why a job of `nodes` nodes with `gpus_per_node` GPUs each can never
    start in `partition` (None: the default one), as sinfo described them; None where it can,
    or where sinfo does not know the partition (a launch is never refused on a guess).
    `spare`: the command has --spare-nodes (a sweep has not)."""
    part = next((p for p in partitions if p.name == partition), None) if partition else next(
        (p for p in partitions if p.default), None)
    if part is None:
        return None
    fit = sum(t.nodes for t in part.types if t.gpus >= gpus_per_node)
    if fit >= nodes:
        return None
    return (f"partition {part.name} has {fit} node(s) with {gpus_per_node} or more GPUs "
            f"(sinfo), and this job asks for {nodes}: SLURM would keep it pending for good; "
            f"check --nodes, --gpus-per-node{' and --spare-nodes' if spare else ''}")


def starting_profile(partitions: list[Partition] | None) -> str:
    """starting_profile is the text of a commented cluster profile: what sinfo said where it
    answered (None: it did not), the built-in defaults otherwise."""
    d = ClusterProfile()
    part = pick(partitions or [])
    lines = ["# A pyrecover cluster profile (`pyrecover launch` options override every key).",
             "# Written by `pyrecover launch --init-cluster` "
             + ("from `sinfo`." if part else "with the defaults: sinfo did not answer."),
             "# Look it over, then launch with: pyrecover launch --nodes 2 --mode dcp", ""]
    if part is None:
        lines += [_line("# partition: gpu", "sinfo -s lists them; unset: the site's default"),
                  _line(f"gpus_per_node: {d.gpus_per_node}", "one task (rank) per GPU"),
                  _line(f'time: "{d.time}"', "quote it: YAML reads some times as numbers")]
    else:
        others = [p.name for p in partitions or [] if p.name != part.name]
        seen = f"; others: {', '.join(others)}" if others else ""
        lines.append(_line(f"partition: {part.name}",
                           ("the default" if part.default else "has GPUs") + seen))
        main = part.main
        gpus = main.gpus or 1
        if len(part.types) > 1:
            lines.append(f"# {part.name}'s nodes differ: " + "; ".join(
                f"{t.nodes} with {t.gpus} GPUs and {t.cpus} CPUs" for t in part.types)
                + f"; the keys below are for the {main.nodes} with {main.gpus} GPUs")
        lines.append(_line(f"gpus_per_node: {gpus}", "one task (rank) per GPU"
                           if main.gpus else "sinfo shows no GPUs: one task per node"))
        if main.cpus >= gpus:
            lines.append(_line(f"cpus_per_task: {main.cpus // gpus}",
                               f"{main.cpus} CPUs per node / {gpus} tasks"))
        limit = part.time_limit
        if limit.lower() in ("infinite", "unlimited", "n/a", ""):
            lines.append(_line(f'time: "{d.time}"', "the partition sets no limit"))
        else:
            lines.append(_line(f'time: "{limit}"',
                               "the partition's longest; shorter jobs start sooner"))
    lines += [
        _line("# account: my-project", "sacctmgr show assoc user=$USER; where one is needed"),
        _line(f"nodes: {d.nodes}", "the default for --nodes"),
        _line(f"signal_seconds: {d.signal_seconds}",
              "the stop signal (run.stop_signal, USR2) this long before the limit"),
        _line(f"max_restarts: {d.max_restarts}",
              "requeues after failures; clean stops always requeue"),
        _line(f"spare_nodes: {d.spare_nodes}", "extra nodes: a failed step restarts on them"),
        "# srun: one task per GPU in the container; torchrun: one torchrun per node; spawn:",
        "# one task per node that starts a worker per GPU; none: this python, no container.",
        f"launcher: {d.launcher}",
        "# image: unset: $PYRECOVER_IMAGE, else ./pyrecover.sif where `make image` built it",
        "# image: /path/to/pyrecover.sif",
        _line("# binds: [/scratch/datasets]", "run.storage is always bound"),
        _line("# qos: normal", "sacctmgr show qos; unset: the account's default"),
        _line('# constraint: "a100&ib"', "node features (sinfo -o %f); quote & | [ ]"),
        _line("# mem: 0", "memory per node, e.g. 256G; 0: all of it"),
        _line("# exclusive: true", "whole nodes, shared with no other job"),
        _line("# sbatch_extra: [--reservation=big]", "more #SBATCH lines, as written"),
        "",
    ]
    return "\n".join(lines)


def _line(text: str, comment: str) -> str:
    return f"{text:<25} # {comment}"


def init_profile(path: str | Path, sinfo_text: str | None,
                 found: Path | None = None) -> str:
    """init_profile writes starting_profile(...) to `path` (never over an existing file),
    checks that it loads, and returns the line to print: the launch to run next, with
    `--cluster PATH` unless `path` is `found`, the profile launch finds without it."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise LaunchError(f"{target} is a folder; --init-cluster writes a file: name one, e.g. "
                          f"{target / 'cluster.yaml'}")
    if target.exists():
        raise LaunchError(f"{target} already exists: edit it, or pass another path to "
                          "--init-cluster")
    blocker = next((folder for folder in target.parents if folder.exists()), None)
    if blocker is not None and not blocker.is_dir():  # the OS said "File exists"
        raise LaunchError(f"cannot write {target}: {blocker} is a file, not a folder; name a "
                          "path in a folder, e.g. --init-cluster "
                          f"{shlex.quote(str(blocker.parent / 'cluster.yaml'))}")
    partitions = parse_sinfo(sinfo_text) if sinfo_text else None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(starting_profile(partitions or None))
    except OSError as exc:
        raise LaunchError(f"cannot write {target}: {exc.strerror or exc}") from None
    load_profile(target, target.parent)
    source = "from sinfo" if partitions else "with the defaults (sinfo did not answer)"
    found_it = found is not None and found.expanduser().absolute() == target.absolute()
    cluster = "" if found_it else f"--cluster {shlex.quote(str(target))} "
    return f"wrote cluster profile {target} {source}; look it over, then: pyrecover launch " \
           f"{cluster}--nodes 2 --mode dcp"


def _number(text: str) -> int:
    m = re.match(r"\d+", text.strip())
    return int(m.group()) if m else 0
