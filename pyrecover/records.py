"""The run's records as read back: those whose fields have the types pyrecover writes.

events.jsonl and metrics.jsonl may hold a hand-edited or foreign line; whatever reads them
(status, the ledger, a resume's count of redone steps, the auto interval's failures) keeps
only the well-formed records, so such a line never stops it. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

# The fields read as numbers anywhere in status, the ledger or the phases.
NUMERIC_FIELDS = ("time", "step", "rank", "blocked", "seconds", "restore_seconds",
                  "steps_lost", "step_time", "checkpoint_stall_total")
TEXT_FIELDS = ("event", "phase", "reason", "error", "job_id", "node")


def well_formed(records: Iterable[dict[str, Any]], needs_time: bool
                ) -> tuple[list[dict[str, Any]], int]:
    """well_formed keeps the records whose fields have the types pyrecover writes (a number
    a float can hold, text); it returns them and how many it left out."""
    kept, skipped = [], 0
    for record in records:
        numbers_ok = all(is_number(record[k]) for k in NUMERIC_FIELDS if k in record)
        texts_ok = all(isinstance(record[k], str) for k in TEXT_FIELDS if k in record
                       and not (k == "job_id" and is_number(record[k])))
        if numbers_ok and texts_ok and (not needs_time or "time" in record):
            kept.append(record)
        else:
            skipped += 1
    return kept, skipped


def is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value)) and abs(value) < 1e15
    except OverflowError:
        return False
