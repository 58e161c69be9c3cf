"""`pyrecover status`'s text: a Status (status.py) as the few aligned lines a person reads.

The same figures as `--json`, the newest few of each list (SHOWN), the ledger with each
cause's share, and the newest interruption phase by phase.
"""

from __future__ import annotations

import time
from typing import Any

from pyrecover.checkpoint.listing import human_age, human_bytes
from pyrecover.profiling import describe
from pyrecover.records import is_number
from pyrecover.status import Status
from pyrecover.status_list import UNREADABLE, Row

SHOWN = 3  # of the requeue decisions and the hangs, the newest; --json has them all


def _earlier(items: list, label: str, what: str) -> list[str]:
    """_earlier is the line saying how many of `items` are older than the ones shown."""
    hidden = len(items) - SHOWN
    return [f"{label}{hidden} earlier {what} in --json"] if hidden > 0 else []


def _slurm_part(s: Status) -> str:
    """_slurm_part is the state line's SLURM job and its state, the job named once (a live
    trainer's state names its job already)."""
    job = "" if f"SLURM job {s.job_id}" in s.state else f" job {s.job_id}"
    if s.slurm_state:
        return f"; SLURM{job}: {s.slurm_state}" + (f" ({s.slurm_reason})" if s.slurm_reason
                                                   else "")
    return f"; SLURM{job}" if s.job_id and job else ""


def _of_max_steps(s: Status) -> str:
    """_of_max_steps is the progress line's limit; one below the step (a start whose config
    lowered it, recorded in run.yaml) read `step 100 of 30`, as if the count had gone wrong."""
    if not s.max_steps:
        return ""
    if s.step > s.max_steps:
        return (f", past train.max_steps={s.max_steps} (run.yaml): a start ends at once; "
                "--set train.max_steps=N to train on")
    return f" of {s.max_steps}"


def render(s: Status) -> str:
    """render is the human view of a Status, a few aligned lines."""
    ck = s.last_checkpoint
    lines = [
        f"run         {s.run_dir} ({s.exp_name})",
        f"state       {s.state}" + _slurm_part(s),
        f"progress    step {s.step}" + _of_max_steps(s),
        f"starts      {s.starts}" + (": restarts " + ", ".join(
            f"{n} x {cause}" for cause, n in sorted(s.restarts_by_cause.items()))
            if s.restarts_by_cause else ""),
        "checkpoint  " + (f"step {ck['step']} ({ck['mode']}, {human_bytes(ck['bytes'])}, "
                          f"{human_age(ck['age_s'])} old; sizes checked, `ckpt verify` reads "
                          "checksums)" if ck else "none"),
        "saves       " + _saves(s),
        f"lost        {s.steps_lost} step{'s' * (s.steps_lost != 1)} redone after "
        "interruptions",
        "goodput     " + _goodput(s),
    ]
    if s.failed_checkpoints:
        newest = s.failed_checkpoints[-1]
        n = len(s.failed_checkpoints)
        lines.append(f"failed      {n} save{'s' * (n > 1)} since the last checkpoint, the "
                     f"newest step {newest.get('step')}: {newest.get('reason')}")
    if s.persisted_snapshots:
        lines.append("snapshots   step" + "s" * (len(s.persisted_snapshots) > 1) + " " +
                     ", ".join(map(str, s.persisted_snapshots)) +
                     " persisted by the survivors of a crash; the next start commits the "
                     "newest whole one")
    for bad in s.invalid_checkpoints[:3]:
        lines.append(f"invalid     checkpoint step {bad['step']}: {bad['problem']}")
    lines += _earlier(s.requeue_decisions, "requeue     ", "decisions")
    for d in s.requeue_decisions[-SHOWN:]:
        in_job = f" (in the job {d['in_job_restart']})" if d.get("in_job_restart") else ""
        lines.append(f"requeue     job {d.get('job_id')} restart {d.get('restart_count')}"
                     f"{in_job}: exit {d.get('exit_code')} -> {d.get('event')} "
                     f"({d.get('reason')})")
    lines += _earlier(s.hangs, "hang        ", "hangs")
    for h in s.hangs[-SHOWN:]:
        lines.append(f"hang        rank {h.get('rank')} on {h.get('node')}: phase {h.get('phase')} "
                     f"of step {h.get('step')} ran {h.get('seconds')}s (limit {h.get('limit')}s)"
                     + _silent(h))
    for g in s.stragglers:
        lines.append(f"straggler   rank {g.get('rank')} on {g.get('node')}: {g.get('seconds')}s "
                     f"own compute per step, "
                     + (f"the other ranks' {g['reference']}s" if "reference" in g else
                        f"median {g.get('median')}s") + f" (step {g.get('step')}, "
                     f"{g.get('windows')} windows in a row)")
    for n in s.excluded_nodes:
        lines.append(f"excluded    {n['node']} since {n['time']}: {n['reason']}")
    if s.profile:
        p = s.profile
        figures = describe({k: v for k, v in p.items() if is_number(v)}) or "no figures"
        lines.append(f"profile     steps {p.get('first')}-{p.get('last')}, per step: {figures}; "
                     f"trace {p.get('trace')}")
    if s.last_error:
        lines.append(f"last error  {s.last_error}")
    if s.skipped_records:
        lines.append(f"skipped     {s.skipped_records} records of events.jsonl/metrics.jsonl "
                     "that are not as pyrecover writes them")
    lines += _ledger_lines(s.ledger, s.job_id) + _interruption_lines(s.interruption)
    return "\n".join(lines)


def _saves(s: Status) -> str:
    """_saves: what checkpoints cost the loop (the ledger's checkpoint stall, one figure with
    its row) and, apart from it, how long they took to write, much of it in the background
    where the mode saves asynchronously."""
    if not (s.checkpoint_stall_seconds or s.checkpoint_write_seconds):
        return "none"
    return (f"loop blocked {s.checkpoint_stall_seconds:.1f}s (the checkpoint stall below, stop "
            f"saves too); {s.checkpoint_write_seconds:.1f}s writing (each save's start to "
            "commit, summed; in the background where async)")


def _goodput(s: Status) -> str:
    """_goodput: the productive share of the launched time, in seconds as the ledger's
    `wall time` line rounds them (`of 8s` stood beside `7.9s`)."""
    if s.goodput is None:
        return "n/a"
    launched = _launched(s.ledger)
    if s.ledger["causes"].get("idle"):
        return (f"{s.goodput:.1%} of the {launched:.1f}s launched in productive training "
                "(the ledger below; idle time between launches left out)")
    return f"{s.goodput:.1%} of {launched:.1f}s wall time in productive training (the ledger below)"


def _ledger_lines(book: dict[str, Any], job_id: str | None) -> list[str]:
    """_ledger_lines: the wall time by cause, adding up to the wall; each cause's share is of
    the launched time (the wall less idle time between launches), as the effective share."""
    wall = book.get("wall_seconds") or 0.0
    if wall <= 0:
        return []
    share = book.get("effective_share") or 0.0
    idle, launched = book["causes"].get("idle", 0.0), _launched(book)
    out = [f"wall time   {wall:.1f}s across all attempts"
           + (f", {idle:.1f}s of it idle between launches; of the {launched:.1f}s launched,"
              if idle else ",") + f" {share:.1%} effective training; by cause"
           + (" (no queue times: sacct did not answer)"
              if job_id and not book["queue_from_slurm"] else "") + ":"]
    for cause, seconds in book["causes"].items():
        # rounded as the effective share is, so productive's row reads as it does
        of = "      -" if cause == "idle" else f"{_unsigned(seconds / launched, 4, 3):7.1%}" if (
            launched) else ""
        out.append(f"  {cause.replace('_', ' '):<18} {_unsigned(seconds, 3, 1):9.1f}s {of}"
                   .rstrip())
    return out


def _unsigned(value: float, digits: int, shown: int) -> float:
    """_unsigned is `value` rounded to `digits`, or 0.0 where `shown` digits print it as zero:
    the remainder absorbs the causes' rounding (-0.002 s), which printed as `-0.0s -0.0%`."""
    value = round(value, digits)
    return value if round(value, shown) else 0.0


def _launched(book: dict[str, Any]) -> float:
    """_launched: the ledger's wall time less its idle time between launches."""
    return float(book.get("launched_seconds") or book.get("wall_seconds") or 0.0)


def _interruption_lines(rows: list[dict[str, Any]]) -> list[str]:
    """_interruption_lines: one line per phase of the last interruption, with the seconds since
    the phase before and since the first."""
    if not rows:
        return []
    first = rows[0]["time"]
    out = ["last interruption (seconds: since the phase before, since the first)"]
    for row in rows:
        clock = time.strftime("%H:%M:%S", time.localtime(row["time"]))
        cache = row.get("compile_cache")
        note = (f"  (compile cache: {cache['hits']} hits, {cache['misses']} misses)"
                if cache else "")
        if "built_s" in row:  # checkpoint_chosen: where its seconds went (phases.CHOICE_TIMES)
            beside = (f", checksums beside it {row['verify_s']:.2f}s"
                      if "verify_s" in row else "")
            note = (f"  (model built {row['built_s']:.2f}s{beside}, then waited "
                    f"{row.get('wait_s', 0.0):.2f}s)")
        out.append(f"  {row['phase']:<18} {clock}  +{row['gap']:7.3f}  "
                   f"{row['time'] - first:8.3f}{note}")
    return out


def _silent(hang: dict[str, Any]) -> str:
    """_silent names the peers a hang found silent and the node the job script excludes for
    it (hang_report.handle): the rank that waited is usually the healthy one."""
    if not hang.get("silent_ranks"):
        return ""
    nodes = hang.get("silent_nodes") or []
    where = f" on {', '.join(map(str, nodes))}" if nodes else ""
    suspect = f", suspect node {hang['suspect_node']}" if hang.get("suspect_node") else ""
    return f"; silent ranks {hang['silent_ranks']}{where}{suspect}"


def render_rows(rows: list[Row]) -> str:
    """render_rows is `status STORAGE`'s table: one aligned line per run or sweep (Row,
    status_list.py), the state last, where its words may run long."""
    table = [("NAME", "STEP", "CHECKPOINT", "JOB", "SLURM", "GOODPUT", "STATE")]
    for r in rows:
        run = r.kind == "run" and not r.state.startswith(UNREADABLE)
        step = "-" if not run else f"{r.step}" + (
            "" if not r.max_steps else f"/{r.max_steps}" if (r.step or 0) <= r.max_steps
            else f" (past max_steps {r.max_steps})")  # `100/30` read as a miscount
        ckpt = "-" if not run else "none" if r.checkpoint_step is None else (
            f"step {r.checkpoint_step} ({human_age(r.checkpoint_age_s)} old)")
        goodput = "-" if r.goodput is None else f"{r.goodput:.1%}"
        state = (f"sweep of {r.trials} trial{'s' * (r.trials != 1)}: {r.hint}"
                 if r.state == "sweep" else r.state)
        table.append((r.name, step, ckpt, r.job_id or "-", r.slurm_state or "-", goodput,
                      state))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    return "\n".join("  ".join([*(line[i].ljust(w) for i, w in enumerate(widths)), line[-1]])
                     for line in table)
