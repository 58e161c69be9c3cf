"""`pyrecover plot`: a picture whose marks sit at the steps the events happened, in the format
the file's suffix names."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from pyrecover import plot
from pyrecover.cli import app
from pyrecover.rundir import RunDir


def read_png(path: Path) -> Image.Image:
    """read_png opens the file as a PNG (Pillow checks its chunks) and returns it as RGB."""
    image = Image.open(path)
    assert image.format == "PNG"
    return image.convert("RGB")


@pytest.fixture
def interrupted_run(tmp_path) -> RunDir:
    """A run killed after step 35 and resumed from 30, that then crashed and was stopped."""
    run = RunDir(tmp_path / "run")
    run.create()
    clock = 1000.0
    for step in range(1, 36):
        run.metric(step=step, loss=5.0 - step * 0.05, tokens_per_s=1000.0 + step,
                   time=clock + step)
        if step % 10 == 0:
            run.event("checkpoint", step=step, blocked=0.01 * step, time=clock + step + 0.5)
    run.event("resume", step=30, steps_lost=5, time=2000.0)
    for step in range(31, 61):
        run.metric(step=step, loss=3.5 - (step - 30) * 0.03, tokens_per_s=1100.0,
                   time=2000.0 + step)
        if step % 10 == 0:
            run.event("checkpoint", step=step, blocked=0.2, time=2000.5 + step)
        if step == 52:
            run.event("crash", error="RuntimeError: boom", time=2000.7 + step)  # no step
    run.event("stop", step=58, time=2100.0)
    return run


def test_the_png_is_valid_of_the_size_asked_for_and_not_blank(interrupted_run, tmp_path):
    out = tmp_path / "run.png"
    plot.write(interrupted_run.root, out, width=640, height=360)
    image = read_png(out)
    assert image.size == (640, 360)
    colors = image.getcolors(maxcolors=1 << 20)
    assert len(colors) > 20  # curves, marks, text: not one flat color
    white = sum(n for n, c in colors if c == (255, 255, 255))
    assert white < 0.95 * 640 * 360


def test_marks_sit_at_the_steps_of_their_events_and_nowhere_else(interrupted_run, tmp_path):
    out = tmp_path / "run.png"
    layout = plot.write(interrupted_run.root, out, width=800, height=400)
    pixels = read_png(out).load()
    inside = range(layout.top + 1, layout.bottom)

    def column(step: int) -> set[tuple[int, int, int]]:
        return {pixels[layout.x(step), y] for y in inside}

    # Interruptions: one color over the whole height, at the step of the event.
    assert column(30) == {plot.RESUME}
    assert column(52) == {plot.CRASH}  # the crash had no step: the last one logged before it
    assert column(58) == {plot.STOP}
    # Checkpoints: a tick along the bottom of the plot.
    for step in (10, 20, 40, 50):
        assert pixels[layout.x(step), layout.bottom - 4] == plot.CHECKPOINT
    # Between marks there is no mark color at all.
    marks = {plot.RESUME, plot.CRASH, plot.STOP, plot.CHECKPOINT}
    for step in (5, 25, 45):
        assert not column(step) & marks
    # The loss is drawn: dark pixels near where step 5's loss lands.
    x, y = layout.x(5), layout.y(5.0 - 5 * 0.05)
    near = {pixels[x, y + d] for d in range(-3, 4)}
    assert plot.LOSS in near


def test_a_requeue_the_job_script_records_in_whole_seconds_sits_at_the_step_it_followed(
        tmp_path):
    """The job script writes its requeue record with `date +%s`: the second it happened in,
    cut down. A run stopped at step 10 a few tenths of a second into that second, steps 9 and
    10 logged in it too, gets its requeue mark at 10 with the stop, not at step 8."""
    run = RunDir(tmp_path / "run")
    run.create()
    for step in range(1, 21):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0,
                   time=1000.5 + 0.3 * step if step <= 10 else 1020.0 + 0.3 * step)
    run.event("stop", step=10, reason="SIGUSR2", time=1003.6)
    run.event("requeue", job_id="7", exit_code=75, reason="stopped cleanly", time=1003)
    run.event("resume", step=10, steps_lost=0, time=1020.0)
    assert [(m.step, m.kind) for m in plot.marks(*records(run))] == [
        (10, "stop"), (10, "requeue"), (10, "resume")]


def run_stopped_at(tmp_path: Path, steps: int, last: int) -> RunDir:
    """run_stopped_at is a run whose metrics go to `steps`, with a pause of half a minute
    after step `last` (where the test records how the first start ended)."""
    run = RunDir(tmp_path / "run")
    run.create()
    for step in range(1, steps + 1):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0,
                   time=1000.0 + step if step <= last else 1030.0 + step)
    return run


def colors_at(run: RunDir, step: int, tmp_path: Path) -> set[tuple[int, int, int]]:
    """colors_at: the colors of the plot's column at `step`, inside the loss panel."""
    out = tmp_path / "run.png"
    layout = plot.write(run.root, out, width=800, height=400)
    pixels = read_png(out).load()
    return {pixels[layout.x(step), y] for y in range(layout.top + 1, layout.bottom)}


def test_a_resume_at_the_step_of_the_stop_it_followed_leaves_the_stop_in_sight(tmp_path):
    """A run stopped at step 10 and resumed there, nothing lost: the blue resume was drawn
    over the orange stop, and the plot showed no stop at all."""
    run = run_stopped_at(tmp_path, 20, 10)
    run.event("stop", step=10, reason="SIGUSR2", time=1010.5)
    run.event("resume", step=10, steps_lost=0, time=1030.0)
    seen = colors_at(run, 10, tmp_path)
    assert {plot.STOP, plot.RESUME} <= seen, seen


def test_a_crash_stays_red_under_the_requeue_that_followed_it(tmp_path):
    """The job script's requeue after a crash lands on the crash's step; drawn after it, in
    orange, it hid the red line: a sweep trial killed at step 6 read as stopped there."""
    run = run_stopped_at(tmp_path, 12, 6)
    run.event("crash", rank=1, error="RuntimeError: Connection reset by peer", time=1006.2)
    run.event("requeue", job_id="7", exit_code=137, reason="crash", time=1006)
    run.event("resume", step=4, steps_lost=2, time=1030.0)
    assert colors_at(run, 6, tmp_path) == {plot.CRASH}


def test_a_task_killed_with_no_event_of_its_own_is_red_from_the_job_script_s_requeue(
        tmp_path):
    """SIGKILL leaves no `crash` event, only the job script's requeue (exit 137, reason
    crash): drawn orange and called a stop, the kill read as a clean stop."""
    run = RunDir(tmp_path / "run")
    run.create()
    for step in range(1, 13):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0,
                   time=1000.0 + step if step <= 6 else 1030.0 + step)
    run.event("requeue", job_id="7", exit_code=137, reason="crash", time=1006)
    run.event("resume", step=4, steps_lost=2, time=1030.0)
    assert [(m.step, m.kind) for m in plot.marks(*records(run))] == [
        (6, "failed_requeue"), (4, "resume")]
    out = tmp_path / "run.png"
    layout = plot.write(run.root, out, width=800, height=400)
    pixels = read_png(out).load()
    assert {pixels[layout.x(6), y] for y in range(layout.top + 1, layout.bottom)} == \
        {plot.CRASH}
    svg = tmp_path / "run.svg"
    plot.write(run.root, svg)
    legend = svg.read_text()
    assert "crash" in legend and "stop" not in legend  # named as drawn


def records(run: RunDir) -> tuple[list[dict], list[dict]]:
    from pyrecover.rundir import read_jsonl

    return read_jsonl(run.events), read_jsonl(run.metrics)


def test_foreign_lines_in_the_run_records_are_left_out_of_the_plot(interrupted_run, tmp_path):
    clean = plot.write(interrupted_run.root, tmp_path / "clean.png", width=800, height=400)
    for path in (interrupted_run.events, interrupted_run.metrics):
        with path.open("a") as f:
            f.write('{"event": "crash", "time": "soon"}\n{"step": 70, "time": "x", "loss": 1}\n'
                    '{"event": "resume", "step": 3, "steps_lost": 1e999, "time": 1}\n')
    mixed = plot.write(interrupted_run.root, tmp_path / "mixed.png", width=800, height=400)
    assert mixed == clean
    assert read_png(tmp_path / "mixed.png").tobytes() == read_png(tmp_path / "clean.png").tobytes()


def test_the_svg_names_the_resume_and_the_second_panel(interrupted_run, tmp_path):
    out = tmp_path / "run.svg"
    plot.write(interrupted_run.root, out)
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "resume at 30, lost 5 steps" in text
    assert "tokens/s" in text and "checkpoint stall" in text


def test_a_pdf_is_written_when_the_suffix_asks_for_one(interrupted_run, tmp_path):
    out = tmp_path / "run.pdf"
    plot.write(interrupted_run.root, out)
    assert out.read_bytes().startswith(b"%PDF")


def test_each_start_is_its_own_curve_so_redone_steps_are_drawn_again():
    metrics = [{"step": s, "loss": 1.0} for s in (1, 2, 3, 2, 3, 4)]
    assert [s.steps for s in plot.segments(metrics)] == [[1, 2, 3], [2, 3, 4]]


def test_plot_command_writes_the_file_and_says_so(interrupted_run, tmp_path):
    out = tmp_path / "cli.png"
    result = CliRunner().invoke(app, ["plot", str(interrupted_run.root), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_png(out).size == (960, 540)


def test_a_metrics_file_copied_off_the_cluster_alone_is_plotted(interrupted_run, tmp_path):
    alone = tmp_path / "copied"
    alone.mkdir()
    (alone / "metrics.jsonl").write_bytes(interrupted_run.metrics.read_bytes())
    out = tmp_path / "alone.png"
    result = CliRunner().invoke(app, ["plot", str(alone), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_png(out).size == (960, 540)


@pytest.mark.filterwarnings("error")  # matplotlib's "constrained_layout not applied"
def test_a_run_without_checkpoints_gets_full_size_panels(tmp_path):
    """An empty checkpoint line (no checkpoint committed yet, or metrics.jsonl copied alone)
    collapsed the layout: both panels drawn a few pixels high."""
    run = RunDir(tmp_path / "young")
    run.create()
    for step in range(1, 20):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0, time=1000.0 + step)
    layout = plot.write(run.root, tmp_path / "young.png")
    assert layout.bottom - layout.top > 0.4 * 540, layout
    assert layout.y_min < 3.2 and layout.y_max > 4.8


def test_a_plot_is_never_written_into_the_runs_checkpoints(interrupted_run, tmp_path):
    for out in (interrupted_run.checkpoints / "step-10" / "x.png",
                interrupted_run.checkpoints / "x.png"):
        result = CliRunner().invoke(app, ["plot", str(interrupted_run.root), "--out", str(out)])
        assert result.exit_code == 2 and "inside the run's checkpoints folder" in result.output
        assert not out.exists()


def test_a_run_with_no_logged_loss_is_one_clear_error(tmp_path):
    run = RunDir(tmp_path / "empty")
    run.create()
    result = CliRunner().invoke(app, ["plot", str(run.root), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "no logged losses to plot yet" in result.output
    assert not (tmp_path / "x.png").exists()


def test_a_run_whose_every_loss_is_nan_is_told_it_diverged_not_to_wait(tmp_path):
    run = RunDir(tmp_path / "diverged")
    run.create()
    for step in (1, 2, 3):
        run.metric(step=step, loss=float("nan") if step < 3 else float("inf"), lr=10.0)
    result = CliRunner().invoke(app, ["plot", str(run.root), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "none of its 3 logged losses is finite (the run diverged" in result.output
    assert "yet" not in result.output and not (tmp_path / "x.png").exists()


def test_an_unknown_suffix_is_one_clear_error(interrupted_run, tmp_path):
    out = tmp_path / "run.gif"
    result = CliRunner().invoke(app, ["plot", str(interrupted_run.root), "--out", str(out)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: {out}: unknown format '.gif'; use .png, .svg, .pdf"]
    assert not out.exists()


@pytest.mark.parametrize("size, said", [
    (("100000", "100000"), "100000x100000 is too large; use at most 8192x8192"),
    (("0", "540"), "0x540 is too small; use at least 320x200"),
])
def test_a_size_out_of_range_is_one_clear_error_before_anything_is_drawn(interrupted_run,
                                                                          tmp_path, size, said):
    out = tmp_path / "run.png"
    result = CliRunner().invoke(app, ["plot", str(interrupted_run.root), "--out", str(out),
                                      "--width", size[0], "--height", size[1]])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"error: {said}"]
    assert not out.exists()


def test_out_in_a_new_folder_is_written_and_one_below_a_file_is_one_clear_error(
        interrupted_run, tmp_path):
    out = tmp_path / "plots" / "2026" / "run.png"
    result = CliRunner().invoke(app, ["plot", str(interrupted_run.root), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert read_png(out).size == (960, 540)
    (tmp_path / "a-file").write_text("x")
    blocked = tmp_path / "a-file" / "run.png"
    result = CliRunner().invoke(app, ["plot", str(interrupted_run.root), "--out", str(blocked)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: {blocked}: cannot create its folder {blocked.parent}: a file is in the way"]


def test_a_full_disk_is_a_storage_fault_that_leaves_the_old_plot_as_it_was(
        interrupted_run, tmp_path, monkeypatch):
    """A plot that cannot be written (ENOSPC) ended with exit 2, a user's mistake, and left
    the file it was replacing cut off at 0 bytes: it is written beside and renamed, and the
    failure is a fault (StorageError: exit 1), as for `ckpt export`."""
    import errno

    from matplotlib.figure import Figure

    from pyrecover.rundir import StorageError

    out = tmp_path / "run.png"
    plot.write(interrupted_run.root, out)
    before = out.read_bytes()

    def full(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG")  # what got out before the disk filled up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    with pytest.raises(StorageError, match="storage: cannot write .*No space left on device"):
        plot.write(interrupted_run.root, out)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run.png"]

    def pdf_full(self, fname, **kwargs):  # matplotlib's PDF writer, as it fails on ENOSPC
        import zlib
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise zlib.error("Error -2 while flushing: inconsistent stream state") from None

    monkeypatch.setattr(Figure, "savefig", pdf_full)
    with pytest.raises(StorageError, match="No space left on device"):  # not a traceback
        plot.write(interrupted_run.root, tmp_path / "run.pdf")


def test_an_error_is_red_and_named_an_error_not_a_crash(tmp_path):
    """A run refused for its data (exit 2) said "crash" in the legend: no process crashed."""
    run = RunDir(tmp_path / "run")
    run.create()
    for step in range(1, 6):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0, time=1000.0 + step)
    run.event("error", rank=0, error="DataError: the corpus changed", time=1005.5)
    svg = tmp_path / "run.svg"
    plot.write(run.root, svg)
    text = svg.read_text()
    assert "error" in text and "crash" not in text


def test_a_hang_is_red_and_named_a_hang_where_no_job_script_recorded_it(tmp_path):
    """A local run whose rank hung (exit 76) and was started again drew no mark at all:
    only a requeue marked the failure, and outside a job there is none. The hang sits at
    the last step logged before the watchdog fired, as a crash does."""
    run = RunDir(tmp_path / "run")
    run.create()
    for step in range(1, 8):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0, time=1000.0 + step)
    for rank, phase in ((0, "backward"), (1, "forward")):
        run.event("hang", rank=rank, node="vm", phase=phase, step=8, seconds=5.0, limit=5.0,
                  time=1012.0)
    for step in range(1, 12):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0, time=1030.0 + step)
    assert [(m.step, m.kind) for m in plot.marks(*records(run))] == [(7, "hang"), (7, "hang")]
    out = tmp_path / "run.png"
    layout = plot.write(run.root, out, width=800, height=400)
    pixels = read_png(out).load()
    assert {pixels[layout.x(7), y] for y in range(layout.top + 1, layout.bottom)} == \
        {plot.CRASH}
    svg = tmp_path / "run.svg"
    plot.write(run.root, svg)
    text = svg.read_text()
    assert "hang" in text and "crash" not in text


def test_a_start_over_after_a_kill_before_the_first_checkpoint_is_drawn_as_a_resume_at_0(
        tmp_path):
    """Killed at step 7 with no checkpoint yet, the run started again from step 0: status
    counted 7 steps lost, the plot drew no mark and no lost work at all."""
    run = RunDir(tmp_path / "run")
    run.create()
    run.event("start", step=0, time=1000.0)
    for step in range(1, 8):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0, time=1000.0 + step)
    run.event("start", step=0, time=1030.0)
    for step in range(1, 21):
        run.metric(step=step, loss=5.0 - step * 0.1, tokens_per_s=1000.0, time=1030.0 + step)
    assert [(m.step, m.kind, m.lost) for m in plot.marks(*records(run))] == [(0, "resume", 7)]
    out = tmp_path / "run.png"
    layout = plot.write(run.root, out, width=800, height=400)
    pixels = read_png(out).load()
    # the redone steps, shaded (under the grid's lines)
    assert plot.LOST in {pixels[layout.x(4), layout.top + d] for d in range(36, 44)}


@pytest.mark.parametrize("size", [(320, 200), (400, 250), (960, 540)])
def test_at_any_size_the_legend_leaves_the_panels_room_and_nothing_is_cut_off(
        interrupted_run, tmp_path, size):
    """At 320x200, the smallest size allowed, the legend took half the picture: the loss
    panel was 22 pixels high, and the right axis's label ran off the bottom edge."""
    width, height = size
    out = tmp_path / "small.png"
    layout = plot.write(interrupted_run.root, out, width=width, height=height)
    assert layout.bottom - layout.top >= 0.25 * height  # the loss panel
    pixels = read_png(out).load()
    edges = [(x, y) for x in range(width) for y in (0, height - 1)] + [
        (x, y) for x in (0, width - 1) for y in range(height)]
    assert {pixels[p] for p in edges} == {(255, 255, 255)}  # drawn inside its margins
