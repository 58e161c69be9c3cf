"""How an exception reads in a one-line error (pyrecover/oneline.py)."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from pyrecover.oneline import LIMIT, first_line


@pytest.mark.parametrize("exc, line", [
    (ValueError("\n  bad value  \nmore"), "bad value"),
    (ValueError(""), "ValueError"),
    (RuntimeError("Error(s) in loading state_dict for GPT:\n\tMissing key(s): wte"),
     "Error(s) in loading state_dict for GPT: Missing key(s): wte"),
    (OSError("x" * 1000), "x" * LIMIT),
])
def test_an_error_reads_as_its_first_line_within_the_limit(exc, line):
    assert first_line(exc) == line


def test_a_dcp_failure_reads_as_each_ranks_own_error_once():
    exc = dcp.api.CheckpointException("save", {
        0: (OSError("No space left on device"), None), 1: (OSError("No space left on device"),
                                                          None), 2: (KeyError("w"), None)})
    assert first_line(exc) == "KeyError: 'w'; OSError: No space left on device"


def test_failures_of_another_kind_never_hide_the_error_itself():
    """torchelastic's ChildFailedError holds ProcessFailure records, not (exception, tb):
    reading them as DCP's raised inside the handler that was about to report the error."""
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="/nonexistent")
    exc = ChildFailedError("train", {0: failure})
    assert first_line(exc) == first_line(Exception(str(exc)))


class _Runs:
    def __reduce__(self):  # what a hostile pickle does: call something on load
        return (print, ("ran",))


@pytest.mark.parametrize("payload", ["global", "protocol"])
def test_a_file_torch_refuses_to_load_reads_as_what_it_held_not_how_to_load_it_unsafely(
        tmp_path, payload):
    import pickle

    import torch

    path = tmp_path / "state.pt"
    if payload == "global":
        torch.save({"a": _Runs()}, path)
    else:  # a raw pickle of another protocol: torch's own unpickler meets an unknown operand
        path.write_bytes(pickle.dumps(_Runs(), protocol=4))
    with pytest.raises(Exception) as refused:
        torch.load(path, weights_only=True)
    line = first_line(refused.value)
    assert line.startswith("Weights only load failed: the file holds more than tensors"), line
    assert line.endswith("; it is not loaded") and "weights_only" not in line, line
    assert "\n" not in line and len(line) <= LIMIT
    if payload == "global":
        assert "(Unsupported global: GLOBAL print was not an allowed global by default)" in line
