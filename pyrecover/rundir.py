"""The run directory: where one experiment keeps its config, events, metrics and checkpoints.

    <storage>/<exp_name>/
      run.yaml  job.sbatch  events.jsonl  metrics.jsonl  logs/  checkpoints/step-<N>/  wandb/

Appends to the JSONL files are single `write` calls of one line each, so a reader never sees
half a record from a live writer, and a killed writer leaves at most one torn last line,
which `read_jsonl` skips. This module imports nothing else from the project.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "run.yaml"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def job_script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    def create(self) -> None:
        """create makes the folders; safe to call on every start and on every rank."""
        for path in (self.root, self.checkpoints, self.logs):
            path.mkdir(parents=True, exist_ok=True)

    def is_run(self) -> bool:
        """is_run tells whether this folder looks like a pyrecover run directory."""
        return self.config.is_file() or self.events.is_file() or self.checkpoints.is_dir()

    def problem(self) -> str | None:
        """problem says why this is no run directory to read (None when it is one)."""
        if not self.root.is_dir():
            return f"run directory {str(self.root)!r} does not exist"
        if not self.is_run():
            return (f"{self.root} is not a pyrecover run directory (no run.yaml, events.jsonl "
                    "or checkpoints/)")
        return None

    def event(self, event: str, **fields: Any) -> dict[str, Any]:
        """event appends one record to events.jsonl with the time, host and SLURM job id."""
        record = {"event": event, "time": round(time.time(), 3), **fields}
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            record.setdefault("job_id", job)
            record.setdefault("restart_count", int(os.environ.get("SLURM_RESTART_COUNT", "0")))
            array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get(
                "SLURM_ARRAY_TASK_ID")
            if array and task:  # a sweep's trial: SLURM names the task ARRAYID_TASKID
                record.setdefault("array_task", f"{array}_{task}")
        record.setdefault("host", socket.gethostname())
        append_jsonl(self.events, record)
        return record

    def metric(self, **fields: Any) -> None:
        append_jsonl(self.metrics, {"time": round(time.time(), 3), **fields})

    def read_events(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.events))

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics))


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """append_jsonl writes one JSON line with a single O_APPEND write."""
    line = (json.dumps(record, sort_keys=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """read_jsonl yields each complete record; a torn or garbled line is skipped."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record
