"""`pyrecover plot`: where a run's time went, from its `metrics.jsonl` and `events.jsonl`.

Two panels over the same steps, drawn with matplotlib (Agg: no display needed), which is
imported only when a plot is drawn. The top panel is the loss with the run's marks:

- checkpoint: a green tick along the bottom and a faint dotted line;
- resume: blue, at the step the run resumed from, labelled with the steps it had to redo,
  which are shaded (the lost work); a start over from step 0 after logged steps is one too;
  dashed where a stop or crash shares its step, which shows through;
- crash, error, hang, and the job script's requeue or restart after a failure (a task
  SIGKILLed records no event of its own): red, at the last step logged before the event;
- stop / signal, and a requeue after a clean stop: orange.

The bottom panel is the training throughput (tokens/s) and, on its right axis, how long each
checkpoint stalled the loop. A resumed run redoes the steps after its checkpoint: each
start's curve is drawn in turn, so the redone stretch is drawn over the lost one. The file's
suffix picks the format: `.png`, `.svg` or `.pdf`.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyrecover.checkpoint.listing import outside_checkpoints
from pyrecover.checkpoint.store import CheckpointError
from pyrecover.phases import JOB_SCRIPT_EVENTS
from pyrecover.records import well_formed
from pyrecover.rundir import RunDir, read_jsonl, storage_error

Color = tuple[int, int, int]
LOSS: Color = (40, 40, 40)
THROUGHPUT: Color = (100, 100, 100)
CHECKPOINT: Color = (44, 160, 44)
CHECKPOINT_LINE: Color = (190, 225, 190)
RESUME: Color = (31, 119, 180)
CRASH: Color = (214, 39, 40)
STOP: Color = (255, 127, 14)
LOST: Color = (198, 219, 239)

# Which events mark an interruption, and in which color.
MARKS: dict[str, Color] = {"resume": RESUME, "crash": CRASH, "error": CRASH, "hang": CRASH,
                           "stop": STOP, "requeue": STOP, "signal": STOP,
                           "failed_requeue": CRASH}
NAMES = {"failed_requeue": "crash", "requeue": "stop", "signal": "stop"}
"""The legend's word for a mark of each kind that has another."""
FORMATS = (".png", ".svg", ".pdf")
MAX_SIDE = 8192  # pixels: a 4K or print-size image fits; 100000 would need 40 GB
DPI = 100


class PlotError(ValueError):
    """The run directory has nothing to plot, or the plot cannot be written; says why."""


@dataclass
class Series:
    """One start's logged values of one metric, in step order."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Mark:
    step: int
    kind: str  # checkpoint, resume, crash, error, hang, stop, requeue, signal, failed_requeue
    label: str = ""  # drawn beside the mark: the steps a resume had to redo
    lost: int = 0  # steps a resume redoes
    stall: float | None = None  # seconds a checkpoint blocked the loop


def segments(metrics: Iterable[Mapping[str, Any]], key: str = "loss") -> list[Series]:
    """segments splits metrics.jsonl into one series per start: a new one where step drops."""
    out: list[Series] = []
    last = None
    for m in metrics:
        step, value = m.get("step"), m.get(key)
        if not isinstance(step, int) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        if last is None or step <= last:
            out.append(Series())
        out[-1].steps.append(step)
        out[-1].losses.append(float(value))
        last = step
    return out


def marks(events: Iterable[Mapping[str, Any]],
          metrics: Sequence[Mapping[str, Any]] = ()) -> list[Mark]:
    """marks lists checkpoints and interruptions with their step.

    An event without a step (a crash) is placed at the last step logged before it; one the
    job script recorded (a requeue) carries `date +%s`, the second it happened in cut down,
    so it is placed at the last step logged before that second ended.
    """
    timeline = sorted((float(m.get("time", 0.0)), int(m["step"])) for m in metrics
                      if isinstance(m.get("step"), int))
    out = []
    for e in events:
        kind = e.get("event")
        if kind in ("requeue", "restart_in_job") and not str(e.get("reason", "")).startswith(
                "stopped cleanly"):  # a crash, hang or failed check: the job script's word
            kind = "failed_requeue"
        if kind == "start":  # after logged steps: a start over, no checkpoint was left
            before = [s for when, s in timeline if when <= float(e.get("time", 0.0))]
            if before:
                out.append(Mark(0, "resume", f"lost {before[-1]}", before[-1]))
            continue
        if kind != "checkpoint" and kind not in MARKS:
            continue
        step = e.get("step") if kind != "hang" else None  # (a hang's is the unfinished one)
        if not isinstance(step, int):
            t = float(e.get("time", 0.0)) + (1.0 if kind in JOB_SCRIPT_EVENTS else 0.0)
            before = [s for when, s in timeline if when <= t]
            if not before:
                continue
            step = before[-1]
        lost = e.get("steps_lost") if kind == "resume" else None
        stall = e.get("blocked") if kind == "checkpoint" else None
        out.append(Mark(step, str(kind), f"lost {lost}" if isinstance(lost, int) else "",
                        lost if isinstance(lost, int) else 0,
                        float(stall) if isinstance(stall, (int, float)) else None))
    return out


@dataclass(frozen=True)
class Layout:
    """Where the loss panel's data lands in the picture, in pixels from the top left."""

    left: int
    top: int
    right: int
    bottom: int
    x_min: float
    x_max: float
    y_min: float
    y_max: float

    def x(self, step: float) -> int:
        span = (self.x_max - self.x_min) or 1.0
        return round(self.left + (step - self.x_min) / span * (self.right - self.left))

    def y(self, value: float) -> int:
        span = (self.y_max - self.y_min) or 1.0
        return round(self.bottom - (value - self.y_min) / span * (self.bottom - self.top))


def write(run_dir: str | Path, out: str | Path, width: int = 960, height: int = 540) -> Layout:
    """write draws the plot of `run_dir` into `out`, in the format its suffix names."""
    run = RunDir(Path(run_dir))
    out = Path(out)
    problem = run.problem()
    if problem is not None:
        raise PlotError(problem)
    if width < 320 or height < 200:
        raise PlotError(f"{width}x{height} is too small; use at least 320x200")
    if width > MAX_SIDE or height > MAX_SIDE:  # Agg allocates width x height x 4 bytes at once
        raise PlotError(f"{width}x{height} is too large; use at most {MAX_SIDE}x{MAX_SIDE}")
    try:  # a file there would change a committed step (export and convert refuse it too)
        outside_checkpoints(out, run, "--out")
    except CheckpointError as exc:
        raise PlotError(str(exc)) from None
    if out.suffix.lower() not in FORMATS:
        raise PlotError(f"{out}: unknown format {out.suffix or '(no suffix)'!r}; "
                        f"use {', '.join(FORMATS)}")
    metrics = well_formed(read_jsonl(run.metrics), needs_time=False)[0]  # foreign lines out
    series = segments(metrics)
    if not series:
        diverged = sum(isinstance(m.get("loss"), float) and not math.isfinite(m["loss"])
                       for m in metrics)
        if diverged:  # not "yet": every loss it logged is NaN or infinite
            raise PlotError(f"{run.metrics}: none of its {diverged} logged losses is finite "
                            "(the run diverged: a lower train.lr, or see pyrecover status)")
        raise PlotError(f"{run.metrics}: no logged losses to plot yet")
    found = marks(well_formed(read_jsonl(run.events), needs_time=True)[0], metrics)
    fig, layout = _draw(run.root.name, series, segments(metrics, "tokens_per_s"), found,
                        width, height)
    # Written beside and renamed: a failed write (a full disk) leaves the old plot whole.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder; name a file")
        try:
            fig.savefig(tmp, format=out.suffix.lower()[1:], dpi=DPI)
            os.replace(tmp, out)
        except Exception as exc:  # the PDF writer's zlib.error, raised while its ENOSPC was
            err = _os_error(exc)  # handled: the OSError behind it is what went wrong
            if err is None or err is exc:
                raise
            raise err from None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where a folder of --out should be
        raise PlotError(f"{out}: cannot create its folder {out.parent}: a file is in the "
                        "way") from None
    except (IsADirectoryError, PermissionError) as exc:  # the user's path: exit 2
        raise PlotError(f"{out}: {exc.strerror or exc}") from None
    except OSError as exc:  # the storage (full, read-only, I/O error): a fault, exit 1
        raise storage_error("write", out, exc) from None
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return layout


def _os_error(exc: BaseException | None) -> OSError | None:
    """_os_error is `exc` or the OSError it was raised while handling, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _rgb(color: Color) -> tuple[float, float, float]:
    return (color[0] / 255, color[1] / 255, color[2] / 255)


def _draw(title: str, losses: list[Series], speed: list[Series], found: list[Mark],
          width: int, height: int):
    """_draw builds the figure; returns it and the loss panel's layout in pixels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text in an SVG: searchable
    fig, (top, low) = plt.subplots(2, 1, sharex=True, figsize=(width / DPI, height / DPI),
                                   dpi=DPI, height_ratios=(3, 2), layout="constrained")
    size = _font_size(width, height)
    fig.suptitle(title[:80], fontsize=size, x=0.02, ha="left")
    steps = [s for ser in losses for s in ser.steps] + [m.step for m in found]
    for m in found:  # checkpoints first: interruptions are drawn over them
        if m.kind == "checkpoint":
            top.axvline(m.step, color=_rgb(CHECKPOINT_LINE), linestyle=":", linewidth=1,
                        zorder=1)
        elif m.kind == "resume" and m.lost:
            top.axvspan(m.step, m.step + m.lost, color=_rgb(LOST), zorder=0, linewidth=0)
    ticks = [m.step for m in found if m.kind == "checkpoint"]
    if ticks:  # (an empty line in axes coordinates collapsed the layout: both panels flat)
        top.plot(ticks, [0] * len(ticks), linestyle="none", marker="|", markersize=12,
                 markeredgewidth=2, color=_rgb(CHECKPOINT), label="checkpoint",
                 transform=top.get_xaxis_transform(), clip_on=False, zorder=4)
    for i, ser in enumerate(losses):
        top.plot(ser.steps, ser.losses, color=_rgb(LOSS), linewidth=1.5, zorder=3,
                 marker="o" if len(ser.steps) == 1 else None, label="loss" if i == 0 else None)
    shown: set[str] = set()
    # A resume at the step of the stop (or crash) it followed, none lost, is dashed over it:
    # drawn whole, it hid that the run had stopped there at all.
    ended = {m.step for m in found if m.kind in MARKS and m.kind != "resume"}
    for m in found:
        if m.kind not in MARKS:
            continue
        name = NAMES.get(m.kind, m.kind)
        over = m.kind == "resume" and m.step in ended
        for ax in (top, low):  # a requeue under the crash or stop it followed, same step
            ax.axvline(m.step, color=_rgb(MARKS[m.kind]), linewidth=2, antialiased=False,
                       zorder=4.5 if m.kind.endswith("requeue") else 5.5 if over else 5,
                       linestyle=(0, (4, 4)) if over else "-",
                       label=None if name in shown or ax is low else name)
        shown.add(name)
        if m.kind == "resume":
            top.annotate(f"resume at {m.step}" + (f", {m.label} steps" if m.label else ""),
                         (m.step, 1), xycoords=top.get_xaxis_transform(), xytext=(4, -4),
                         textcoords="offset points", va="top", fontsize=size * 0.833,
                         color=_rgb(RESUME))
    top.set_ylabel("loss", fontsize=size)
    top.grid(True, color="0.9")
    right = _throughput_panel(low, speed, found, size)
    for ax in (top, low, right):
        ax.tick_params(labelsize=size)
    # One legend for both panels, below them, where it hides no data nor the title.
    handles, labels = [], []
    for ax in (top, low, right):
        h, lab = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    _legend(fig, handles, labels, size * 0.833, width)  # "small", as the annotation
    top.set_xlim(0, max(steps) * 1.02 or 1)
    fig.canvas.draw()  # fixes the layout, so the pixel positions below are final
    box = top.get_window_extent()
    (x0, x1), (y0, y1) = top.get_xlim(), top.get_ylim()
    layout = Layout(left=round(box.x0), top=height - round(box.y1), right=round(box.x1),
                    bottom=height - round(box.y0), x_min=x0, x_max=x1, y_min=y0, y_max=y1)
    return fig, layout


def _legend(fig, handles: list, labels: list[str], size: float, width: int) -> None:
    """_legend puts one legend below the panels in as many columns as fit across the picture
    (one of many rows took half of a small one)."""
    renderer = fig.canvas.get_renderer()
    for ncols in range(len(handles), 0, -1):
        legend = fig.legend(handles, labels, loc="outside lower center", fontsize=size,
                            frameon=False, ncols=ncols, handlelength=1.5, columnspacing=1.0)
        if ncols == 1 or legend.get_window_extent(renderer).width <= 0.96 * width:
            return
        legend.remove()


def _font_size(width: int, height: int) -> float:
    """_font_size: matplotlib's 10 points from 640x360 up, down to 6 at the smallest size, so
    the text of a small picture leaves its panels room."""
    return max(6.0, min(10.0, width / 64, height / 36))


def _throughput_panel(ax, speed: list[Series], found: list[Mark], size: float = 10.0):
    """_throughput_panel draws tokens/s per start and, on a right axis that it returns, each
    checkpoint's stall of the loop."""
    for i, ser in enumerate(speed):
        ax.plot(ser.steps, ser.losses, color=_rgb(THROUGHPUT), linewidth=1,
                label="tokens/s" if i == 0 else None)
    ax.set_ylabel("tokens/s", fontsize=size)
    ax.set_xlabel("step", fontsize=size)
    ax.grid(True, color="0.9")
    stalls = [(m.step, m.stall) for m in found if m.kind == "checkpoint" and m.stall is not None]
    right = ax.twinx()
    right.set_ylabel("checkpoint stall (s)" if size >= 8 else "stall (s)", fontsize=size)
    if stalls:
        right.plot([s for s, _ in stalls], [v for _, v in stalls], linestyle="none",
                   marker="v", color=_rgb(CHECKPOINT), label="checkpoint stall")
        right.set_ylim(0, max(v for _, v in stalls) * 1.2 or 1)
    return right
