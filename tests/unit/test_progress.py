"""The progress bar: only on a terminal, and log lines never land in the middle of it."""

from __future__ import annotations

import io
import logging
import os
import select

from pyrecover import progress


def read_all(fd: int) -> str:
    """read_all drains what the terminal has to give (a read may return part of it)."""
    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


def test_a_batch_log_or_another_rank_gets_no_bar():
    assert progress.for_terminal(0, 100, 0, io.StringIO()) is None
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        assert progress.for_terminal(1, 100, 0, tty) is None
        assert progress.for_terminal(0, 100, 0, tty) is not None
    os.close(master)


def test_the_bar_fits_the_terminal_and_says_steps_loss_rate_and_time_left():
    text = progress.render(30, 120, 2.3456, 12_345.0, 3725.0, width=100)
    assert len(text) < 100
    assert "30/120" in text and "loss 2.3456" in text and "12.3k tok/s" in text
    assert "1:02:05 left" in text and text.startswith("[##########")


def test_a_log_line_clears_the_bar_first_and_the_bar_comes_back_after_it():
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w")
    logger = logging.getLogger("pyrecover-test-progress")
    handler = logging.StreamHandler(tty)
    logger.handlers[:] = [handler]
    bar = progress.Progress(10, 0, tty, logger)
    bar.update(1, 3.0, 100)
    logger.warning("a checkpoint was committed")
    bar.update(2, 2.9, 100)
    bar.close()
    tty.flush()
    out = read_all(master)
    tty.close()
    os.close(master)
    logged = out.index("a checkpoint was committed")
    assert out[:logged].endswith("\r\x1b[K") and "\r[" in out[logged:]
    assert handler.stream is tty  # closing gives the stream back
