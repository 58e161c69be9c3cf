"""`pyrecover plot`: a valid PNG whose marks sit at the steps the events happened."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pyrecover import plot
from pyrecover.cli import app
from pyrecover.rundir import RunDir


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """read_png decodes an 8-bit RGB PNG with unfiltered rows: (width, height, rows)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (size,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + size]
        (crc,) = struct.unpack(">I", data[pos + 8 + size:pos + 12 + size])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + size
    width, height, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    stride = 1 + 3 * width
    assert len(raw) == stride * height
    rows = [raw[y * stride:(y + 1) * stride] for y in range(height)]
    assert all(row[0] == 0 for row in rows)
    return width, height, [row[1:] for row in rows]


def pixel(rows: list[bytes], x: int, y: int) -> tuple[int, int, int]:
    return tuple(rows[y][3 * x:3 * x + 3])


@pytest.fixture
def interrupted_run(tmp_path) -> RunDir:
    """A run killed after step 35 and resumed from 30, that then crashed and was stopped."""
    run = RunDir(tmp_path / "run")
    run.create()
    clock = 1000.0
    for step in range(1, 36):
        run.metric(step=step, loss=5.0 - step * 0.05, time=clock + step)
        if step % 10 == 0:
            run.event("checkpoint", step=step, time=clock + step + 0.5)
    run.event("resume", step=30, steps_lost=5, time=2000.0)
    for step in range(31, 61):
        run.metric(step=step, loss=3.5 - (step - 30) * 0.03, time=2000.0 + step)
        if step % 10 == 0:
            run.event("checkpoint", step=step, time=2000.5 + step)
        if step == 52:
            run.event("crash", error="RuntimeError: boom", time=2000.7 + step)  # no step
    run.event("stop", step=58, time=2100.0)
    return run


def test_the_png_is_valid_and_of_the_size_asked_for(interrupted_run, tmp_path):
    out = tmp_path / "run.png"
    plot.write(interrupted_run.root, out, width=640, height=360)
    width, height, rows = read_png(out)
    assert (width, height) == (640, 360) and len(rows) == 360


def test_marks_sit_at_the_steps_of_their_events_and_nowhere_else(interrupted_run, tmp_path):
    out = tmp_path / "run.png"
    layout = plot.write(interrupted_run.root, out, width=800, height=400)
    _, _, rows = read_png(out)
    inside = range(layout.top + 1, layout.bottom)

    def column(step: int) -> set[tuple[int, int, int]]:
        return {pixel(rows, layout.x(step), y) for y in inside}

    # Interruptions: one color over the whole height, at the step of the event.
    assert column(30) == {plot.RESUME}
    assert column(52) == {plot.CRASH}  # the crash had no step: the last one logged before it
    assert column(58) == {plot.STOP}
    # Checkpoints: a tick along the bottom of the plot.
    for step in (10, 20, 40, 50):
        assert pixel(rows, layout.x(step), layout.bottom - 4) == plot.CHECKPOINT
    # Between marks there is no mark color at all.
    marks = {plot.RESUME, plot.CRASH, plot.STOP, plot.CHECKPOINT}
    for step in (5, 25, 45):
        assert not column(step) & marks
    # The loss is drawn: dark pixels near where step 5's loss lands.
    x, y = layout.x(5), layout.y(5.0 - 5 * 0.05)
    near = {pixel(rows, x, y + d) for d in range(-3, 4)}
    assert plot.LOSS in near


def test_each_start_is_its_own_curve_so_redone_steps_are_drawn_again():
    metrics = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 2, 3, 4)]
    assert [s.steps for s in plot.segments(metrics)] == [[1, 2, 3], [2, 3, 4]]


def test_plot_command_writes_the_file_and_says_so(interrupted_run, tmp_path):
    out = tmp_path / "cli.png"
    result = CliRunner().invoke(app, ["plot", str(interrupted_run.root), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_png(out)[:2] == (960, 540)


def test_a_run_with_no_logged_loss_is_one_clear_error(tmp_path):
    run = RunDir(tmp_path / "empty")
    run.create()
    result = CliRunner().invoke(app, ["plot", str(run.root), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "no logged losses to plot yet" in result.output
    assert not (tmp_path / "x.png").exists()
