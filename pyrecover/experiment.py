"""An experiment's run directory and the config recorded in it, shared by `train` and `launch`.

Imports no torch, so rendering a job script stays light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

from pyrecover import batch, dist, preempt, rundir
from pyrecover import config as config_mod
from pyrecover.config import Config, ConfigError
from pyrecover.dist import DistEnv
from pyrecover.phases import Phases, process_start_time
from pyrecover.rundir import RunDir, StorageError, replace_text
from pyrecover.runlock import HeldByThisJob, RunLock, RunLocked


def resolve_for_run(cfg: Config, world_size: int) -> tuple[Config, str | None]:
    """resolve_for_run fixes the global batch for `world_size`, keeping the run's recorded one
    (pyrecover.batch.resolve); returns the config and the line that says what was chosen."""
    return batch.resolve(cfg, world_size, recorded_global_batch(RunDir(cfg.run_dir())))


def recorded_global_batch(run: RunDir) -> int | None:
    """recorded_global_batch is the global batch run.yaml holds; None without a readable one
    (prepare_run_dir reports a broken run.yaml)."""
    try:
        size = config_mod.load(run.config).train.global_batch_size if run.config.is_file() \
            else None
    except ConfigError:
        return None
    return size if isinstance(size, int) else None


RENAME = "a new run.exp_name (--set run.exp_name=NAME)"  # what a refused config can take


def prepare_run_dir(cfg: Config, run: RunDir, note: str | None = None,
                    lock: RunLock | None = None, wait_s: float = 0.0,
                    corpus: dict | None = None, rename: str = RENAME) -> None:
    """prepare_run_dir creates the run directory and records or checks `run.yaml`.

    A restart whose config changes what the run computes (model, data, seed, global batch) is
    refused; limits such as train.max_steps may change, and run.yaml then records the new
    ones (what `status` and a requeued job read). Where the run lives (run.storage,
    run.exp_name, data.path as written) stays as first recorded, made absolute where this
    start gives it so: the job script restarts with `--config run.yaml` alone, from the run
    directory, so a restart with `--run-dir` must not point it elsewhere. With `lock`, the
    lock is taken (waiting up to `wait_s`; RunLocked when a live run holds it) before
    anything is written, so a refused start changes nothing. `note` says how an `auto`
    global batch was resolved; it goes into run.yaml as a comment (a restart without one
    keeps the old). `corpus` (data.fingerprint of what this start trains on) is recorded
    beside it, for check_corpus.
    """
    old = check_run_dir(cfg, run, rename)
    run.create()
    if lock is not None:
        lock.acquire(wait_s)
    if old is None:
        write_config(_first_record(cfg, run), run, note)
    else:
        _update_config(cfg, old, run, note)
    if corpus is not None:  # after run.yaml, the run's first record
        record_corpus(run, corpus)


def nesting_problem(run: RunDir) -> str | None:
    """nesting_problem says why a new run cannot live in `run.root`: inside another run's
    folder (in its checkpoints/, which that run's retention prunes; through a symbolic link
    too), or in a folder holding other runs (the storage root itself). None where it may,
    and for a run that exists already (its requeue is never refused for a layout an earlier
    version allowed)."""
    if run.config.is_file():
        return None
    if run.is_sweep():  # its trials are runs, but a run named like the sweep is no trial
        return (f"{run.root} holds a sweep ({run.root.name}/sweep.yaml), not a run; use "
                "another run.exp_name")
    real = Path(os.path.realpath(run.root))
    outer = next((p for p in real.parents if RunDir(p).is_recorded_run()), None)
    if outer is not None:
        return (f"{run.root} is inside the run directory {outer} (it has {outer / 'run.yaml'}); "
                "give a folder of its own, outside any run")
    with contextlib.suppress(OSError):
        held = [p.name for p in itertools.islice(real.iterdir(), 1000)
                if p.is_dir() and RunDir(p).is_recorded_run()]
        if held:
            return (f"{run.root} holds other runs ({', '.join(sorted(held)[:3])}); give the "
                    f"run a folder of its own, e.g. {run.root / 'NAME'}")
    return None


def check_run_dir(cfg: Config, run: RunDir, rename: str = RENAME) -> Config | None:
    """check_run_dir refuses (ConfigError) what prepare_run_dir would refuse, writing nothing
    (`launch --dry-run` asks it too): a sweep's folder, or a recorded config whose identity
    keys this one changes. Returns the recorded config (None for a new run)."""
    if run.is_sweep():  # `pyrecover cancel` of the run would then end the sweep's array
        raise ConfigError(f"{run.root} holds a sweep ({run.root.name}/sweep.yaml), not a run; "
                          "use another run.exp_name")
    nested = nesting_problem(run)
    if nested is not None:
        raise ConfigError(nested)
    if not run.config.is_file():
        return None
    try:
        old = config_mod.load(run.config)
    except ConfigError as exc:
        raise ConfigError(f"{run.config} (the run's recorded config): {exc}") from None
    changed = config_mod.diff_identity(old, cfg)
    if changed:
        raise ConfigError(
            f"{run.root} was started with another config ({'; '.join(changed)}); "
            f"use {rename}, or restore the old values")
    return old


def _first_record(cfg: Config, run: RunDir) -> Config:
    """_first_record is `cfg` as a new run's run.yaml records it: run.storage and
    run.exp_name where the run is (with --run-dir too: it recorded the config's), data.path
    absolute, so that `--config run.yaml` restarts it from any folder (a relative data.path
    was taken from wherever the restart ran)."""
    storage, name = run.where
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, path=os.path.abspath(cfg.data.path)),
        run=dataclasses.replace(cfg.run, storage=storage, exp_name=name))


def _update_config(cfg: Config, old: Config, run: RunDir, note: str | None) -> None:
    """_update_config records a restart's limits in run.yaml, keeping where the run lives."""
    # The data file is the same (an identity key); given relative here, absolute there.
    # run.storage and run.exp_name name where run.yaml lives, whatever this start was given
    # (--run-dir): the job's next requeue (`--config run.yaml` alone) comes back here, also
    # after the run was moved or copied to another folder. A path this start gives absolute
    # (launch does) replaces a relative one: the job starts in another folder.
    here, name = run.where
    keep = os.path.abspath(old.run.storage) == here and (
        os.path.isabs(old.run.storage) or not os.path.isabs(cfg.run.storage))
    storage = old.run.storage if keep else here
    data_path = cfg.data.path if os.path.isabs(cfg.data.path) and not os.path.isabs(
        old.data.path) else old.data.path
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, path=data_path),
        run=dataclasses.replace(cfg.run, storage=storage, exp_name=name))
    if config_mod.to_dict(old) != config_mod.to_dict(cfg):
        head = run.config.read_text().split("\n", 1)[0]
        write_config(cfg, run, note or (head[2:] if head.startswith("# ") else None))


def check_corpus(run: RunDir, corpus: dict, data_path: str) -> dict:
    """check_corpus returns `corpus`, or refuses (DataError) a start whose data is not what
    the run's checkpoints were trained on: another corpus written to the same data.path
    would resume its data position into other text without a word. A run without
    checkpoints, or without a record of its corpus (an older run, or one whose record the user
    deleted to go on with other data), starts on any data. A record that is there but is no
    fingerprint (torn, unreadable) is refused like other data, even where the data is the
    same: it cannot tell the one from the other, and only deleting it says to go on."""
    from pyrecover.datasource import DataError  # pyarrow: the trainer has it loaded

    recorded, damage = _read_corpus(run)
    if recorded == corpus or not _holds_checkpoints(run) or (recorded is None and not damage):
        return corpus
    if damage:
        raise DataError(
            f"{run.corpus} is damaged ({damage}): it no longer says what data this run's "
            f"checkpoints were trained on; delete it to go on with {data_path} as it is now, "
            "or start a new run (run.exp_name)")
    then = recorded.get("tokens")
    what = (f"the same {then} tokens, other text" if then == corpus["tokens"]
            else f"{then} tokens then, {corpus['tokens']} now")
    raise DataError(
        f"{data_path} holds other data than this run's checkpoints were trained on ({what}); "
        f"restore that file, or start a new run (run.exp_name), or delete {run.corpus} to go "
        "on with this data")


def hold_same_corpus(corpus: dict, env: DistEnv, data_path: str, run: RunDir) -> None:
    """hold_same_corpus refuses a start whose ranks read other data at `data_path` (`corpus`:
    this rank's data.fingerprint): a node whose local copy is stale or another file, or a
    relative path read from another folder, would train its ranks on other windows than the
    global data order says, without a word. Every rank compares its fingerprint with rank
    0's once the group is up; rank 0 records and raises the DataError (one line, exit 2),
    the others exit 2 without a line."""
    from pyrecover.datasource import DataError  # pyarrow: the trainer has it loaded

    seen = dist.gather_objects((corpus, dist.node_name()), env.world_size)
    odd = next((r for r, (fp, _) in enumerate(seen) if fp != seen[0][0]), None)
    if odd is None:
        return
    (ours, here), (theirs, there) = seen[0], seen[odd]
    what = (f"the same {ours['tokens']} tokens, other text" if ours["tokens"] == theirs["tokens"]
            else f"{theirs['tokens']} tokens there, {ours['tokens']} on rank 0")
    exc = DataError(f"{data_path} holds other data on rank {odd} (node {there}) than on rank 0 "
                    f"(node {here}) ({what}); every rank must read the same corpus: give every "
                    "node the same file, or put data.path on storage they share")
    with contextlib.suppress(Exception):
        dist.teardown()
    if env.rank == 0:
        run.event("error", rank=0, error=f"DataError: {exc}")  # no requeue: the job script
        raise exc
    wait_for_start_error(run)  # (SLURM would end rank 0 before it recorded why)
    raise SystemExit(2)


def _holds_checkpoints(run: RunDir) -> bool:
    """Anything under checkpoints/ may be resumed: a committed step, a memory-mode snapshot or
    a save whose manifest landed (both made into steps once the run's lock is held)."""
    try:
        return any(run.checkpoints.iterdir())
    except OSError:
        return False


def record_corpus(run: RunDir, corpus: dict) -> None:
    """record_corpus writes the fingerprint of the data this start trains on (rank 0, the run's
    lock held) where none is recorded, or where no checkpoint was trained on the old one yet
    (a checkpoint committed while this start waited for the lock keeps its record, and a
    damaged record stays for check_corpus to refuse). Written atomically: a crash leaves the
    old record or the new one, never a torn one."""
    recorded, damage = _read_corpus(run)
    if recorded == corpus or ((recorded is not None or damage) and _holds_checkpoints(run)):
        return
    replace_text(run.corpus, json.dumps(corpus) + "\n")


def _read_corpus(run: RunDir) -> tuple[dict | None, str | None]:
    """_read_corpus returns the recorded fingerprint, or None and what is wrong with a record
    that is there but is none (None and None where there is no record)."""
    try:
        raw = run.corpus.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror or exc}"
    try:
        recorded = json.loads(raw)
    except ValueError:  # UnicodeDecodeError too
        return None, "not valid JSON, torn or overwritten"
    if not (isinstance(recorded, dict) and isinstance(recorded.get("digest"), str)
            and type(recorded.get("tokens")) is int):
        return None, "not a token count and digest"
    return recorded, None


def write_config(cfg: Config, run: RunDir, note: str | None = None) -> None:
    """write_config replaces `run.yaml` atomically with the resolved config."""
    replace_text(run.config, config_mod.dump(cfg, note))


def record_start_error(run: RunDir, phases: Phases, exc: Exception) -> None:
    """record_start_error records a config or data error where a run already exists (a job
    launched earlier: the job script reads it to tell "exit 2, never requeue" from a crash),
    as an attempt of its own (its start-up phases first); a new run directory is not created
    for a mistake, and a live run's directory (its lock held) gets nothing."""
    if not run.is_run():
        return
    lock = RunLock(run) if run.lock_file.exists() else None  # a live run has made one
    try:  # not waited for: the other ranks wait for this record (wait_for_start_error), but
        if lock is not None:  # not for ever, and SLURM would end a waiting rank 0 unheard
            lock.acquire(0.0)
    except (RunLocked, HeldByThisJob, StorageError):
        return
    try:
        phases.attach(run)
        run.event("error", rank=0, error=f"{type(exc).__name__}: {exc}")
    finally:
        if lock is not None:
            lock.release()


def check_data_early(data_path: str, column: str, run: RunDir, env: DistEnv) -> None:
    """check_data_early says a missing or unreadable data file (or its missing column) before
    torch is imported: seconds sooner than the trainer's own check, the same line, recorded in
    an existing run as that start's error (record_start_error) the way the trainer records it.
    Node 0's other ranks exit 2 without a line: rank 0 checked the same file and says it."""
    from pyrecover import datasource  # pyarrow: only where a trainer is about to start

    try:
        datasource.check_source(data_path, column)
    except datasource.DataError as exc:
        if env.rank == 0:
            phases = Phases(0)
            phases.mark("process_start", process_start_time())
            record_start_error(run, phases, exc)
        else:
            wait_for_start_error(run)
            if env.node_rank == 0:
                raise SystemExit(2) from None
        raise


ERROR_WAIT_S = 60.0  # how long the other ranks give rank 0 to record a start error


def wait_for_start_error(run: RunDir, timeout_s: float = ERROR_WAIT_S) -> bool:
    """wait_for_start_error returns once this SLURM attempt's `error` record is in the run's
    events (True), or once a stop signal came (SLURM ends the others when rank 0 exits), or
    after `timeout_s` (False); at once outside SLURM or where there is no run to record it.
    A rank that exits 2 first gets rank 0 ended by SLURM (srun --kill-on-bad-exit) before it
    could record why, and the job script, finding no record, would take a config error for
    a crash and requeue it. The bound covers ranks that read the corpus at other speeds."""
    mine = rundir.attempt_fields(os.environ)
    if not mine or not run.is_run():  # no job script reads it; record_start_error writes none
        return False
    deadline = time.monotonic() + timeout_s
    while preempt.caught_early() is None:  # caught from the process's start (catch_early)
        for record in rundir.read_jsonl(run.events):
            if (record.get("event") == "error"
                    and all(record.get(k) == v for k, v in mine.items())
                    and ("in_job_restart" in mine or "in_job_restart" not in record)):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return False


def hold_run_dir(refused: Exception | None, env: DistEnv) -> None:
    """hold_run_dir tells every rank whether any rank cannot start here (`refused`: this
    rank's reason): a second start on a live run directory (rank 0 did not get its lock), a
    config its run.yaml refuses, or storage a rank cannot create the run in is refused on
    every rank (rank 0 exiting alone would leave the others waiting on its store for
    minutes), before it cleans up anything (the other run's in-flight save) or writes a
    line; rank 0 says why."""
    reasons = dist.gather_objects(refused, env.world_size)
    reason = reasons[0] or next((r for r in reasons if r is not None), None)
    if reason is not None:
        with contextlib.suppress(Exception):
            dist.teardown()
        if env.rank == 0:
            raise reason
        raise SystemExit(2 if isinstance(reason, (RunLocked, ConfigError)) else 1)
