"""How an exception reads in a one-line message: its first line, and for a DCP failure the
ranks' own errors, which say more than the wrapper's "CheckpointException ranks:...". Pure.
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)

LIMIT = 300  # characters: an error line stays one line on a terminal's few widths
WEIGHTS_ONLY = "Weights only load failed"  # torch.load(weights_only=True) refused a file


def first_line(exc: BaseException) -> str:
    """first_line is what `exc` says on its first non-empty line (its type's name where it
    says nothing); for torch's "Error(s) in loading ...:" the line after it as well."""
    failures = getattr(exc, "failures", None)  # DCP's wrapper: the ranks' own errors matter
    if isinstance(failures, dict):  # rank: (exception, traceback); others' (torchelastic's
        errors = [f[0] for f in failures.values()  # ProcessFailure) say nothing of that kind
                  if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
        if errors:
            return "; ".join(sorted({f"{type(e).__name__}: {first_line(e)}" for e in errors}))
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if lines and lines[0].startswith(WEIGHTS_ONLY):  # and its advice to load it unsafely
        marker = "WeightsUnpickler error:"
        at = next((i for i, line in enumerate(lines) if marker in line), len(lines))
        said = (lines[at].partition(marker)[2].strip() or " ".join(lines[at + 1:at + 2])
                if at < len(lines) else "")
        why = said.partition(". ")[0].rstrip(".")  # what it met, not how to allow it
        return (f"{WEIGHTS_ONLY}: the file holds more than tensors and plain containers"
                + (f" ({why})" if why else "") + "; it is not loaded")[:LIMIT]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"[:LIMIT]
    return (lines or [type(exc).__name__])[0][:LIMIT]


def not_a_file(path, kind: str) -> str:
    """not_a_file says why `path` (a pathlib.Path that is no regular file) cannot be read as
    `kind` ("a YAML file"): a folder, something else that is there (a FIFO, a device, a
    socket), or nothing at all."""
    if path.is_dir():
        return f"is a folder, not {kind}"
    if path.exists():
        return f"is not a regular file (a FIFO, a device or a socket), not {kind}"
    return "does not exist"


def said_once(exc: E, rank: int) -> E:
    """said_once marks `exc` as one every rank raises alike, agreed on through a collective
    (the final save failed on some rank, too many non-finite steps): rank 0 prints its line,
    the others end with the same exit code without one, so a job of 512 ranks says it once.
    Returns `exc`, to raise."""
    exc.quiet = rank != 0  # type: ignore[attr-defined]
    return exc


def quiet(exc: BaseException) -> bool:
    """quiet tells whether `exc`'s line is rank 0's to print (said_once), not this rank's."""
    return bool(getattr(exc, "quiet", False))
