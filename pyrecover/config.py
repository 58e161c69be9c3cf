"""Experiment configuration: read YAML and `--set` overrides into the schema, then validate.

Precedence is `--set section.key=value` > YAML file > the schema's defaults, which are
the embedded CPU demo.
Every user mistake raises `ConfigError` with the key, the bad value and what is allowed.
The schema is config_schema.py and the rules config_checks.py; both are re-exported here, so
`from pyrecover.config import Config, ConfigError, load` is all a caller needs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from pyrecover.config_checks import (  # noqa: F401  (re-exported)
    _MOST,
    _bad,
    _choice,
    _positive,
    check_local_gpus,
    check_world_size,
    parse_global_batch,
    short,
    validate,
)
from pyrecover.config_schema import (  # noqa: F401  (re-exported)
    _EXP_NAME,
    CHECKPOINT_MODES,
    DEVICES,
    IDENTITY_KEYS,
    PRECISIONS,
    WANDB_MODES,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrackingConfig,
    TrainConfig,
)
from pyrecover.oneline import not_a_file


def to_dict(cfg: Config) -> dict[str, Any]:
    """to_dict returns plain nested dicts, ready for YAML, JSON or a checkpoint."""
    return dataclasses.asdict(cfg)


def from_dict(raw: Any, source: str = "config") -> Config:
    """from_dict builds and validates a Config from nested mappings, rejecting unknown keys."""
    cfg = _build(Config, raw if raw is not None else {}, "", source)
    validate(cfg)
    # `~/corpus.parquet` in a YAML file, or after `--set key=` (no shell expands it there),
    # means the home folder, not a folder named `~` in the working directory.
    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, storage=os.path.expanduser(cfg.run.storage)),
        data=dataclasses.replace(cfg.data, path=os.path.expanduser(cfg.data.path)))


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """load reads a YAML file (or the defaults when None) and applies `key=value` overrides."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(os.path.expanduser(path))  # `--config=~/exp.yaml`: bash leaves that ~ as is
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} {not_a_file(p, 'a YAML file')}")
        raw = read_yaml(p)
        if raw is None:  # a file truncated to nothing must not train the demo's defaults
            raise ConfigError(f"{p}: holds no settings (empty, or only comments); leave "
                              "--config out to train with the defaults")
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: expected a mapping of sections, got {type(raw).__name__}")
        source = str(p)
    for item in overrides:
        key, value = parse_override(item)
        text = item.partition("=")[2].strip()
        if _check_override_key(key) in (str, str | None) and (
                type(value) in (int, float)
                or (type(value) is bool and text.lower() not in ("true", "false"))):
            # A name or a path that YAML reads as a number or a YAML 1.1 boolean keeps its
            # text: --exp-name 007, 1.10 or yes named the folder 7, 1.1 or true (and 1.10
            # resumed the run of --exp-name 1.1). `true` and `false` stay words.
            value = text
        _set_path(raw, key, value, source)
    return from_dict(raw, source)


MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; a megabyte is no config


_MERGE_TAGS = ("tag:yaml.org,2002:merge", "tag:yaml.org,2002:value")


class _Strict:
    """What every config reader refuses on top of YAML's own rules: aliases (a few hundred
    bytes of nested `*alias` lists, a "billion laughs", expand to gigabytes in memory and in any
    message that repeats them) and a key given twice in one mapping (YAML keeps the last one
    silently; in a config that is a mistake)."""

    name: str
    what = "config file"

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.events.AliasEvent):  # type: ignore[attr-defined]
            mark = self.peek_event().start_mark  # type: ignore[attr-defined]
            raise ConfigError(f"{self.name} line {mark.line + 1}: YAML aliases (*name) are not "
                              f"allowed in a {self.what}; write the value out")
        return super().compose_node(parent, index)  # type: ignore[misc]

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag in _MERGE_TAGS:  # `<<: {...}` merges, which may override
                    continue
                key = self.construct_object(key_node, deep=True)  # type: ignore[attr-defined]
                try:
                    hash(key)
                except TypeError:
                    continue  # YAML's constructor refuses an unhashable key itself
                if key in seen:  # as a dict would merge them: 1 and 1.0, 1 and true
                    # A hashable key is a scalar: its node's value is the key as written.
                    raise ConfigError(f"{self.name} line {key_node.start_mark.line + 1}: key "
                                      f"{short(key_node.value)} appears twice in one mapping; "
                                      "keep one")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _NoAliasLoader(_Strict, yaml.SafeLoader):
    """YAML's safe loader, strict (_Strict)."""


class _StringsLoader(_Strict, yaml.BaseLoader):
    """Every scalar a string (YAML 1.1 would read `time: 1:00:00` as the base-60 integer
    3600), strict (_Strict): for values each field converts itself, as cluster profiles do."""


def read_yaml(p: Path, strings: bool = False, what: str = "config file") -> Any:
    """read_yaml parses a config file (`what` names the kind in messages): UTF-8, at most
    MAX_CONFIG_BYTES, no aliases, no key twice; `strings`: every scalar as written. Raises
    ConfigError in one line."""
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p}: {size} bytes; a {what} is at most {MAX_CONFIG_BYTES} "
                              "bytes")
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot be read ({exc.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                          f"{exc.start})") from None
    try:
        loader = (_StringsLoader if strings else _NoAliasLoader)(text)
    except yaml.YAMLError as exc:  # the reader's: a NUL or another character YAML forbids
        raise ConfigError(f"{p}: not valid YAML ({_reader_problem(exc)})") from None
    loader.name, loader.what = str(p), what
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = f" ({_reader_problem(exc)})" if isinstance(exc, yaml.reader.ReaderError) \
            else ""
        raise ConfigError(f"{p}{where}: not valid YAML{problem}") from None
    except RecursionError:
        raise ConfigError(f"{p}: not valid YAML (nested too deeply)") from None
    except ConfigError:  # the loader's own: a key twice, an alias
        raise
    except ValueError as exc:
        if not _digit_limit(exc):  # a constructor's own refusal (a date like 2024-13-45)
            raise ConfigError(f"{p}: not valid YAML ({short(str(exc))})") from None
        raise ConfigError(f"{p}: holds a number of more than 4300 digits, which is no config "
                          "value") from None
    finally:
        loader.dispose()


def _digit_limit(exc: ValueError) -> bool:
    """_digit_limit: `exc` is int()'s refusal of a number of more than sys's digit limit."""
    return "Exceeds the limit" in str(exc) and "digits" in str(exc)


def _reader_problem(exc: yaml.YAMLError) -> str:
    """_reader_problem names the character YAML's reader refused, and where."""
    if isinstance(exc, yaml.reader.ReaderError):
        code = exc.character if isinstance(exc.character, int) else ord(exc.character[:1] or " ")
        return f"character U+{code:04X} at offset {exc.position}, which YAML forbids"
    return type(exc).__name__


def parse_override(item: str) -> tuple[str, Any]:
    """parse_override splits `section.key=value`; the value is read as YAML (`3`, `1e-3`)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", key):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.max_steps=100")
    try:
        value = yaml.load(text, Loader=_NoAliasLoader) if text.strip() else ""
    except (yaml.YAMLError, ConfigError, RecursionError):
        value = text
    except ValueError as exc:  # more digits than Python converts to an int, or a bad date
        if not _digit_limit(exc):
            return key, text
        raise ConfigError(f"--set {short(item)}: a number of {len(text)} characters is no "
                          "config value") from None
    if not isinstance(value, (str, int, float, bool)):
        value = text  # lists and mappings are not config values; keep the literal text
    elif re.search(r"(^|\s)#", text) and "#" not in str(value):
        value = text.strip()  # YAML read ` #...` as a comment: a path such as `/runs #3`
    return key, value


def dump(cfg: Config, note: str | None = None) -> str:
    """dump renders the resolved config as YAML that `load` reads back to an equal Config;
    `note` (how an `auto` value was resolved) goes first, as a comment."""
    head = f"# {' '.join(note.split())}\n" if note else ""
    return head + yaml.safe_dump(to_dict(cfg), sort_keys=False)


def diff_identity(old: Config, new: Config) -> list[str]:
    """diff_identity lists `key: old -> new` for identity keys that differ between two configs."""
    a, b = _flatten(to_dict(old)), _flatten(to_dict(new))
    if os.path.realpath(a["data.path"]) == os.path.realpath(b["data.path"]):
        b["data.path"] = a["data.path"]  # the same file, given relative once, absolute once
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and any(k == p or k.startswith(p + ".") for p in IDENTITY_KEYS)
    ]


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {short(raw)}")
    odd = next((k for k in raw if not isinstance(k, str)), None)
    if odd is not None:
        raise ConfigError(f"{source}: key {short(odd)} under {where} is not a name")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(
            f"{source}: unknown key {key!r}; known under {prefix.rstrip('.') or 'top level'}: "
            + ", ".join(fields)
        )
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        key = prefix + name
        if dataclasses.is_dataclass(hint):
            # A section with every key commented out is null: its defaults. `train: 0` is
            # no section.
            kwargs[name] = _build(hint, {} if value is None else value, key + ".", source)
        else:
            kwargs[name] = _coerce(key, value, hint)
    return cls(**kwargs)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    if hint == int | str:  # an int, or a word such as `auto`
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}={value!r} is not allowed: expected a whole number or a "
                              "word such as auto")
        if isinstance(value, int) and not -2**63 <= value < 2**63:
            raise ConfigError(f"{key}={short(value)} is not allowed: expected a 64-bit integer")
        return value
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{key}={short(value)} is not allowed: expected a finite "
                              "number") from None
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads `2e-3` (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={short(value)} is not allowed: expected a finite number")
    if hint is int and type(value) is int and not -2**63 <= value < 2**63:
        raise ConfigError(f"{key}={short(value)} is not allowed: expected a 64-bit integer")
    if hint is str and isinstance(value, bool):
        return "true" if value else "false"  # `compile: true` in YAML
    if hint is str and isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        what = {int: "a whole number", float: "a number"}.get(hint, f"a {hint.__name__}")
        if isinstance(value, bool):  # `off`, `no`: a word the user typed, YAML's boolean
            raise ConfigError(f"{key}={str(value).lower()} is not allowed: expected {what} "
                              "(YAML reads on/off and yes/no as true/false)")
        raise ConfigError(f"{key}={short(value)} is not allowed: expected {what}")
    return value


def _check_override_key(dotted: str) -> Any:
    """_check_override_key refuses a `--set` key the schema does not have, naming `--set`
    (not the config file, which may be fine) and the keys that exist there; returns the
    key's type."""
    cls: Any = Config
    prefix = ""
    for part in dotted.split("."):
        where = prefix.rstrip(".")
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"--set {dotted}: {where} is a value, not a section")
        fields = [f.name for f in dataclasses.fields(cls)]
        if part not in fields:
            raise ConfigError(f"--set {dotted}: unknown key {prefix + part!r}; known under "
                              f"{where or 'top level'}: {', '.join(fields)}")
        cls = typing.get_type_hints(cls)[part]
        prefix += part + "."
    if dataclasses.is_dataclass(cls):
        raise ConfigError(f"--set {dotted}: {dotted!r} is a section; set one of its keys, e.g. "
                          f"{dotted}.{dataclasses.fields(cls)[0].name}=...")
    return cls


def _set_path(raw: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for depth, part in enumerate(parents):
        if node.get(part) is None:  # absent, or a section with every key commented out
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):  # the key is in the schema, so the file has it wrong
            where = ".".join(parents[:depth + 1])
            raise ConfigError(f"{source}: {where} must be a mapping, got {short(child)}")
        node = child
    node[leaf] = value


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
