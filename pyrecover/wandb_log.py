"""How far an earlier start's wandb run got: the last history step in its transaction log.

wandb writes every run, online or offline, to `<run dir>/wandb/<offline->run-<time>-<id>/
run-<id>.wandb`: LevelDB-style framing (32 KiB blocks of records, each with a 7-byte header:
CRC, length, kind; a record longer than a block is split into first, middle and last pieces)
around protobuf `Record`s. A start killed with SIGKILL (a node failure, the OOM killer) loses
what wandb had not yet written, so that log, not metrics.jsonl, says which steps the next start
must log again. Only the end of the file is read: a reader can start at any block boundary.

Imports wandb's protobuf module only when a log is read; every failure reads as "not known".
"""

from __future__ import annotations

import struct
from pathlib import Path

MAGIC = b":W&B"
HEADER = 7  # the file's: magic, a 2-byte key, a version byte
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
TAIL = 1 << 20  # bytes read first from the end; doubled while they hold no history record


def last_history_step(path: Path) -> int | None:
    """last_history_step is the highest `step=` of a history record in the transaction log
    `path`, or None when it has none or cannot be read (no file, not a wandb log, no wandb).
    A torn record at the end (a kill mid-write) ends the reading, as `wandb sync` does."""
    try:
        from wandb.proto import wandb_internal_pb2 as pb

        with path.open("rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            size = f.seek(0, 2)
            tail = TAIL
            while True:
                start = max(0, (size - tail) // BLOCK * BLOCK)
                f.seek(start)
                step = _last_step(f.read(), start, pb)
                if step is not None or start == 0:
                    return step
                tail *= 2
    except Exception:  # noqa: BLE001 - a log we cannot read only means "not known"
        return None


def _last_step(data: bytes, start: int, pb) -> int | None:
    """_last_step scans records from the block boundary `start` (file offset of data[0])."""
    pos = HEADER if start == 0 else 0
    best, buf, whole = None, b"", start == 0  # mid-file, pieces before a first one are skipped
    while pos + HEADER <= len(data):
        left = BLOCK - (start + pos) % BLOCK
        if left < HEADER:  # a block's last bytes too few for a header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + HEADER + length > len(data) or kind not in (FULL, FIRST, MIDDLE, LAST):
            break  # torn, or not a record: what follows cannot be trusted
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, FIRST):
            buf, whole = chunk, True
        elif whole:
            buf += chunk
        if kind in (FULL, LAST) and whole:
            record = pb.Record()
            try:
                record.ParseFromString(buf)
            except Exception:  # noqa: BLE001 - a damaged record ends what can be trusted
                break
            if record.WhichOneof("record_type") == "history":
                best = max(best or 0, int(record.history.step.num))
            buf = b""
    return best


def newest_log(wandb_dir: Path, run_id: str) -> Path | None:
    """newest_log is the transaction log of the last start that opened wandb run `run_id`
    (its folder names begin with the start time, so the newest sorts last), or None."""
    logs = [p for p in wandb_dir.glob(f"*run-*-{run_id}/run-{run_id}.wandb")
            if p.parent.name.removeprefix("offline-").startswith("run-")]
    return max(logs, key=lambda p: p.parent.name.removeprefix("offline-"), default=None)
