"""Cluster profiles: where and how a job runs (partition, GPUs per node, image, binds, time).

A profile is a YAML mapping whose keys are the fields of `ClusterProfile`
(launch/clusters/*.yaml); `pyrecover launch` options override any of them (`with_overrides`).
Every mistake raises LaunchError naming the key, the bad value and what is allowed.
Relative paths (image, bind sources) are taken from the directory `pyrecover launch` runs in
and made absolute, because the job runs elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyrecover import container
from pyrecover.config import ConfigError, read_yaml, short
from pyrecover.container import Bind
from pyrecover.slurm import LaunchError, extra

LAUNCHERS = ("srun", "torchrun", "spawn", "none")
MAX_SIGNAL_SECONDS = 65535  # SLURM keeps --signal's time in 16 bits
# SLURM's --time forms: MM, MM:SS, HH:MM:SS, D-, D-HH, D-HH:MM, D-HH:MM:SS (`1-` is a day).
_TIME = re.compile(r"(?:(\d+)-(?:(\d+)(?::(\d+)(?::(\d+))?)?)?|(\d+)(?::(\d+)(?::(\d+))?)?)")
_NO_LIMIT = ("infinite", "unlimited", "-1")
# sbatch rounds the seconds up to minutes in a C int: a longer limit overflows into nonsense
# (`--time=24855-03:13:09` became TimeLimit=2957761-01:02:00).
MAX_TIME_SECONDS = 2**31 - 1 - 59
_NAME = re.compile(r"[A-Za-z0-9._,-]+")  # partition (comma-separated list), account, qos
# SLURM feature expressions: `a100&ib`, `[rack1|rack2]`, `gpu80gb*2`, `(a|b)&c`.
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.,&|\[\]*():-]+")
_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
_NULL = ("", "~", "null", "Null", "NULL")  # YAML's null, read as a string
_BOOL = {"true": True, "yes": True, "on": True, "1": True,
         "false": False, "no": False, "off": False, "0": False}


@dataclass(frozen=True)
class ClusterProfile:
    nodes: int = 1
    """Nodes per job; `--nodes` overrides it."""
    gpus_per_node: int = 4
    """GPUs per node, and so tasks (ranks) per node."""
    cpus_per_task: int | None = None
    """CPU cores per task, i.e. per GPU; unset leaves it to the site's default."""
    time: str = "01:00:00"
    """SLURM time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or infinite."""
    partition: str | None = None
    account: str | None = None
    image: str | None = None
    """Apptainer image (.sif). Launcher srun needs one; torchrun uses it when set."""
    binds: tuple[Bind, ...] = ()
    """Bind mounts `SRC[:DST[:ro]]` besides run.storage, which is always bound."""
    launcher: str = "srun"
    """srun: one task per GPU in the container; torchrun: one torchrun per node; spawn: one
    task per node running `pyrecover train --nproc <gpus_per_node>`; none: one task per GPU
    running this machine's python, no container."""
    max_restarts: int = 3
    """How often the job may requeue itself after a failure: a crash, a hang, a failed
    health check, or a clean stop that trained no step. A clean stop (the time limit,
    preemption) always requeues."""
    spare_nodes: int = 0
    """Extra nodes allocated beside `nodes`: training runs on `nodes` of them, and after a
    crash, hang or failed health check a new step starts at once on the healthy ones."""
    max_restarts_in_job: int = 2
    """With spare nodes: restarts inside the allocation before the job requeues instead."""
    signal_seconds: int = 120
    """SLURM sends run.stop_signal (USR2 by default) to every task this many seconds before
    the time limit; 0: no signal (the trainer then stops on its own deadline prediction)."""
    qos: str | None = None
    """SLURM quality of service (`--qos`); unset leaves it to the account's default."""
    constraint: str | None = None
    """Node features the job needs (`--constraint`), e.g. `a100&ib` or `[rack1|rack2]`."""
    mem: str | None = None
    """Memory per node (`--mem`): a number with an optional K, M, G or T suffix (MB without
    one); 0 means all of each node's memory. Unset leaves it to the site's default."""
    exclusive: bool = False
    """Whole nodes only (`--exclusive`): no other job shares them."""
    sbatch_extra: tuple[str, ...] = ()
    """Further sbatch options, one `#SBATCH` line each, e.g. `--reservation=big`: `--name` or
    `--name=value`, never one pyrecover sets itself (pyrecover.slurm.extra)."""


FIELDS = tuple(f.name for f in dataclasses.fields(ClusterProfile))


def option_name(key: str) -> str:
    """option_name is the `pyrecover launch` option that overrides profile key `key`."""
    return {"binds": "--bind", "exclusive": "--exclusive/--no-exclusive"}.get(
        key, "--" + key.replace("_", "-"))


PROFILE_ENV, IMAGE_ENV = "PYRECOVER_CLUSTER", "PYRECOVER_IMAGE"
USER_PROFILE = Path(".config", "pyrecover", "cluster.yaml")  # under the home directory
LOCAL_IMAGE = "pyrecover.sif"  # what `make image` builds, looked for where launch runs


def find_profile(option: str | Path | None, environ: Mapping[str, str], home: str | Path,
                 exists: Callable[[Path], bool] = Path.is_file) -> Path:
    """find_profile picks the cluster profile: `--cluster`, else $PYRECOVER_CLUSTER, else
    ~/.config/pyrecover/cluster.yaml when it exists. Raises LaunchError when none is set. A
    leading `~` is the home folder (bash leaves it in `--cluster=~/site.yaml`)."""
    if option is not None and not str(option).strip():  # `--cluster "$X"`, X unset: not '.'
        raise LaunchError("--cluster is empty; name a cluster profile YAML, e.g. --cluster "
                          "launch/clusters/local.yaml, or leave it out (then "
                          f"${PROFILE_ENV}, else ~/{USER_PROFILE})")
    if option is not None:
        return Path(option).expanduser()
    if environ.get(PROFILE_ENV):
        named = Path(environ[PROFILE_ENV]).expanduser()
        if not exists(named):  # the variable, not an option, is what to fix
            what = "a folder" if named.is_dir() else "no file"
            raise LaunchError(f"{PROFILE_ENV}={str(named)!r} names {what}: point it at a "
                              "cluster profile YAML, unset it, or pass --cluster FILE")
        return named
    user = Path(home) / USER_PROFILE
    if exists(user):
        return user
    raise LaunchError(f"no cluster profile: pass --cluster FILE, set {PROFILE_ENV}, or write "
                      f"~/{USER_PROFILE} with `pyrecover launch --init-cluster ~/{USER_PROFILE}`")


def find_image(profile: ClusterProfile, environ: Mapping[str, str], cwd: str | Path,
               exists: Callable[[Path], bool] = Path.is_file) -> ClusterProfile:
    """find_image fills in the image where the profile (or --image) sets none: $PYRECOVER_IMAGE,
    else ./pyrecover.sif when `make image` built it there. Launcher none never uses one."""
    if profile.image is not None or profile.launcher == "none":
        return profile
    image = environ.get(IMAGE_ENV) or None
    if image is None and exists(Path(cwd) / LOCAL_IMAGE):
        image = LOCAL_IMAGE
    return absolute(dataclasses.replace(profile, image=image), cwd)


def resolve(option: str | Path | None, environ: Mapping[str, str], home: str | Path,
            cwd: str | Path, binds: tuple[str, ...] = (), sbatch_extra: tuple[str, ...] = (),
            check: bool = True, **overrides: Any) -> ClusterProfile:
    """resolve is the profile a submission uses, the same for `launch` and `sweep launch`:
    found (find_profile), read, the command line's options over it (None: not given), its
    image found (find_image), every value checked (validate) unless not `check`: a caller
    that changes it first (a sweep drops the spare nodes) validates what it submits."""
    found = find_profile(option, environ, home)
    profile = with_overrides(load_profile(found, cwd), cwd, binds=binds,
                             sbatch_extra=sbatch_extra, **overrides)
    profile = find_image(profile, environ, cwd)
    if check:
        validate(profile)
    return profile


def load_profile(path: str | Path | None, cwd: str | Path) -> ClusterProfile:
    """load_profile reads a cluster profile (the defaults when None); paths made absolute.
    It is read as a config is (config.read_yaml: UTF-8, size-capped, no aliases, no key
    twice), every scalar a string: each field converts its own (`_coerce`)."""
    if path is None:
        return ClusterProfile()
    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a YAML file" if p.is_dir() else "does not exist"
        raise LaunchError(f"cluster profile {str(p)!r} {what} (see launch/clusters/)")
    try:
        raw = read_yaml(p, strings=True, what="cluster profile")
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None
    # Empty, or only comments: the defaults (every scalar is a string here, so an empty
    # document after `---` reads as '').
    return from_mapping({} if raw in (None, "") else raw, str(p), cwd)


def from_mapping(raw: Any, source: str, cwd: str | Path) -> ClusterProfile:
    """from_mapping builds a ClusterProfile from a mapping of strings, rejecting unknown keys."""
    if not isinstance(raw, dict):
        raise LaunchError(f"{source}: expected a mapping of profile keys, got {short(raw)}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise LaunchError(f"{source}: unknown cluster profile key {unknown[0]!r}; known keys: "
                          + ", ".join(sorted(FIELDS)))
    hints = typing.get_type_hints(ClusterProfile)
    values: dict[str, Any] = {}
    lists = {"binds": "SRC[:DST[:ro]] paths", "sbatch_extra": "sbatch options --name=value"}
    for key, value in raw.items():
        if key in lists:
            # YAML's null (`binds: ~`, as `partition: ~` is elsewhere): no entries, not a
            # folder named `~` (the home folder) or `null`.
            items = [] if value in _NULL else [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise LaunchError(f"{source}: {key}={short(value)} is not allowed: expected a "
                                  f"list of {lists[key]}")
            values[key] = tuple(parse_bind(v, cwd) for v in items) if key == "binds" else \
                tuple(items)
        else:
            values[key] = _coerce(source, key, value, hints[key])
    return absolute(ClusterProfile(**values), cwd)


def with_overrides(profile: ClusterProfile, cwd: str | Path, binds: tuple[str, ...] = (),
                   sbatch_extra: tuple[str, ...] = (), **overrides: Any) -> ClusterProfile:
    """with_overrides replaces the fields given (None means not given) and adds `binds` and
    `sbatch_extra` to the profile's."""
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise TypeError(f"not cluster profile keys: {unknown}")
    given = {k: v for k, v in overrides.items() if v is not None}
    added = tuple(parse_bind(b, cwd) for b in binds)
    return absolute(dataclasses.replace(profile, **given, binds=profile.binds + added,
                                        sbatch_extra=profile.sbatch_extra + sbatch_extra), cwd)


def parse_bind(text: str, cwd: str | Path) -> Bind:
    """parse_bind reads `SRC[:DST[:ro|rw]]` (pyrecover.container.parse_bind) with SRC made
    absolute from `cwd` (a leading `~` is the home folder, as in the config: YAML and bash in
    `--bind=~/x` leave it), and DST spelled out (the same path when not given)."""
    try:
        bind = container.parse_bind(text)
    except container.ContainerError as exc:
        raise LaunchError(str(exc)) from None
    src = os.path.abspath(os.path.join(cwd, os.path.expanduser(bind.src)))
    return dataclasses.replace(bind, src=src, dst=bind.dst or src)


def absolute(profile: ClusterProfile, cwd: str | Path) -> ClusterProfile:
    """absolute makes the image path absolute, taken from `cwd` when relative, from the home
    folder after a leading `~`. A blank one stays as it is, for validate to refuse (made
    absolute, it would name `cwd`)."""
    if profile.image is None or not profile.image.strip():
        return profile
    image = os.path.expanduser(profile.image)
    return dataclasses.replace(profile, image=os.path.abspath(os.path.join(cwd, image)))


def validate(profile: ClusterProfile) -> None:
    """validate checks every value; raises LaunchError naming the key and its option."""
    for key in ("nodes", "gpus_per_node"):
        _at_least(key, getattr(profile, key), 1)
    if profile.cpus_per_task is not None:
        _at_least("cpus_per_task", profile.cpus_per_task, 1)
    for key in ("max_restarts", "spare_nodes", "max_restarts_in_job"):
        _at_least(key, getattr(profile, key), 0)
    # what sbatch (--nodes: with the spares) and srun (--ntasks) are given is a count too
    for (a, b), total in ((("nodes", "spare_nodes"), profile.nodes + profile.spare_nodes),
                          (("nodes", "gpus_per_node"), profile.nodes * profile.gpus_per_node)):
        if total > MAX_COUNT:
            how = "+" if b == "spare_nodes" else "x"
            raise LaunchError(f"{a} {how} {b} = {total} ({option_name(a)}, {option_name(b)}) "
                              f"is not allowed: expected at most {MAX_COUNT}")
    if not 0 <= profile.signal_seconds <= MAX_SIGNAL_SECONDS:
        _bad("signal_seconds", profile.signal_seconds, f"0 to {MAX_SIGNAL_SECONDS} seconds")
    if profile.launcher not in LAUNCHERS:
        _bad("launcher", profile.launcher, "one of " + ", ".join(LAUNCHERS))
    limit = time_seconds(profile.time)
    if limit is not None and limit <= profile.signal_seconds:
        _bad("time", profile.time, f"a limit longer than signal_seconds "
             f"({profile.signal_seconds} s; SLURM makes this one {limit} s), or the stop "
             "signal comes at the start")
    for key in ("partition", "account", "qos"):
        value = getattr(profile, key)
        if value is not None and not _NAME.fullmatch(value):
            _bad(key, value, "letters, digits, '.', '_', '-' (a list separated by ',')")
    if profile.constraint is not None and not _CONSTRAINT.fullmatch(profile.constraint):
        _bad("constraint", profile.constraint, "a SLURM feature expression of letters, digits "
             "and _ . - , & | [ ] * ( ) : without spaces, e.g. a100&ib")
    if profile.mem is not None and not _MEM.fullmatch(profile.mem):
        _bad("mem", profile.mem, "memory per node: a number with an optional K, M, G or T "
             "suffix, e.g. 64G; 0 for all of it")
    if profile.image is not None and not profile.image.strip():
        _bad("image", profile.image, "the path of an apptainer image (.sif)")
    for item in profile.sbatch_extra:
        extra.check(item)


def time_seconds(text: str) -> int | None:
    """time_seconds is the limit SLURM gives a job for `sbatch --time=text`, in seconds; None
    for no limit.

    As SLURM (22.05, measured with scontrol) does: a field may overflow into the next
    (`1-25` is 2-01:00:00, `0:75:00` is 01:15:00), `1-` is a day, and seconds round up to
    whole minutes (`90:30` is 01:31:00, `0:0:30` is 00:01:00). Raises LaunchError for
    anything `sbatch --time` would reject, and for a limit past SLURM's largest, which it
    garbles (a negative one, `-2`, included).
    """
    if text.lower() in _NO_LIMIT:
        return None
    m = _TIME.fullmatch(text)
    if not m:
        _bad("time", text, "MM, MM:SS, HH:MM:SS, D-, D-HH, D-HH:MM, D-HH:MM:SS or infinite")
    d, dh, dm, ds, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if d is not None:
        seconds = d * 86400 + (dh or 0) * 3600 + (dm or 0) * 60 + (ds or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # MM:SS
        seconds = a * 60 + b
    else:  # MM
        seconds = a * 60
    if seconds > MAX_TIME_SECONDS:
        _bad("time", text, f"at most {MAX_TIME_SECONDS // 86400} days, or infinite")
    return -(-seconds // 60) * 60 or None  # SLURM reads a limit of 0 as no limit


def _coerce(source: str, key: str, value: Any, hint: Any) -> Any:
    optional = type(None) in typing.get_args(hint)
    if optional and value in _NULL:
        return None
    base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if not isinstance(value, str):
        raise LaunchError(f"{source}: {key}={short(value)} is not allowed: expected a single "
                          "value")
    if base is int:
        if not re.fullmatch(r"-?\d+", value.strip()):
            raise LaunchError(f"{source}: {key}={short(value)} is not allowed: expected an "
                              "integer")
        return int(value)
    if base is bool:
        if value.strip().lower() not in _BOOL:
            raise LaunchError(f"{source}: {key}={short(value)} is not allowed: expected true "
                              "or false (yes/no, on/off, 1/0)")
        return _BOOL[value.strip().lower()]
    return value


MAX_COUNT = 2**31 - 1
"""The largest count sbatch reads (a C int: `--cpus-per-task=2147483648` is refused at submit)
and the job script's bash compares without an error."""


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        _bad(key, value, f"an integer >= {low}")
    if value > MAX_COUNT:
        _bad(key, value, f"an integer {low} to {MAX_COUNT}")


def _bad(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise LaunchError(f"{key}={short(value)} is not allowed: expected {allowed} "
                      f"(cluster profile key {key}, option {option_name(key)})")
