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
