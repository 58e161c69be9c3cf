"""`checkpoint.interval: auto`: the Young/Daly rule over a table of stalls and failure figures."""

from __future__ import annotations

import math

import pytest

from pyrecover import config
from pyrecover.checkpoint import interval as iv

HOUR = 3600.0


@pytest.mark.parametrize("stall_s, step_s, mtbf_s, max_steps, expected", [
    # sqrt(2 x 2 s x 24 h) = 587.9 s of 1 s steps
    (2.0, 1.0, 24 * HOUR, 100_000, 588),
    # four times the stall: twice the interval
    (8.0, 1.0, 24 * HOUR, 100_000, 1176),
    # a quarter of the MTBF: half the interval
    (2.0, 1.0, 6 * HOUR, 100_000, 294),
    # steps of 0.5 s: twice the steps for the same seconds
    (2.0, 0.5, 24 * HOUR, 100_000, 1176),
    # a tiny stall and frequent failures: bounded below by MIN_SECONDS (10 s)
    (0.001, 0.1, 60.0, 100_000, 100),
    # a huge stall and a reliable machine: bounded above by MAX_SECONDS (6 h)
    (600.0, 1.0, 1000 * HOUR, 10**9, 21_600),
    # never past the run's own length
    (2.0, 1.0, 24 * HOUR, 300, 300),
    # nothing measured yet: the first, short interval
    (0.0, 0.0, 24 * HOUR, 100_000, iv.FIRST_STEPS),
])
def test_the_interval_is_young_daly_in_steps_within_its_bounds(stall_s, step_s, mtbf_s,
                                                               max_steps, expected):
    assert iv.interval_steps(stall_s, step_s, mtbf_s, max_steps) == expected


def test_seconds_follow_the_square_root_rule():
    assert iv.young_daly_seconds(2.0, 24 * HOUR) == pytest.approx(math.sqrt(2 * 2 * 86400))


@pytest.mark.parametrize("prior_h, observed_h, failures, expected_h", [
    (24, 0, 0, 24),    # nothing seen: the prior
    (24, 24, 0, 48),   # a day without failure: the estimate grows
    (24, 24, 3, 12),   # three failures in a day: (24 + 24) / 4
    (1, 99, 9, 10),    # the run's own record outweighs a small prior
])
def test_the_mtbf_counts_the_prior_as_one_failure_free_period(prior_h, observed_h, failures,
                                                                 expected_h):
    assert iv.mtbf(prior_h * HOUR, observed_h * HOUR, failures) == pytest.approx(expected_h * HOUR)


def test_crashes_and_kills_are_failures_and_stops_that_saved_their_checkpoint_are_not():
    events = [
        {"event": "start", "time": 0}, {"event": "stop", "time": 100, "reason": "SIGUSR2"},
        {"event": "resume", "time": 110}, {"event": "crash", "time": 200},
        {"event": "resume", "time": 210}, {"event": "stop", "time": 300, "reason": "SIGTERM"},
        {"event": "resume", "time": 310}, {"event": "checkpoint", "time": 400},  # killed
        {"event": "resume", "time": 410}, {"event": "stop", "time": 500, "reason": "deadline"},
        {"event": "resume", "time": 510}, {"event": "finish", "time": 600},
    ]
    observed, failures = iv.failures_seen(events)
    # The crash and the kill; a preemption's SIGTERM stop saved its checkpoint and lost nothing.
    assert failures == 2 and observed == 100 + 5 * 90


@pytest.mark.parametrize("end, failures", [
    ({"event": "crash", "time": 200}, 1),
    ({"event": "checkpoint", "time": 200}, 1),  # then killed: no record of its end
    ({"event": "stop", "time": 200, "reason": "SIGTERM"}, 0),  # preempted, saved: nothing lost
    ({"event": "stop", "time": 200, "reason": "deadline"}, 0),
])
def test_the_attempt_just_ended_counts_at_once_and_the_gap_after_it_is_not_training(end,
                                                                                    failures):
    # What a resume reads: the attempt before it, then the job script's requeue and the new
    # start's phases. Its first failure shortened nothing before (it waited for one more).
    events = [{"event": "start", "time": 0}, end,
              {"event": "requeue", "time": 230, "exit_code": 1},
              {"event": "cancel", "time": 250, "job_id": "7"},  # the requeued job, queued
              {"event": "phase", "time": 300, "phase": "process_start"},
              {"event": "phase", "time": 303, "phase": "imports_done"}]
    assert iv.failures_seen(events) == (200.0, failures)
    steps, auto = iv.for_config("auto", 4.0, 1000, events)
    assert auto.mtbf_s == pytest.approx((4 * HOUR + 200) / (1 + failures))


def test_what_a_start_records_before_it_trains_belongs_to_no_attempt_s_training():
    # A second start writes its health check and recovered snapshots before its resume: they
    # neither stretch the first attempt over the requeue gap nor close it as ended well.
    events = [{"event": "phase", "time": 0, "phase": "process_start"},
              {"event": "start", "time": 10}, {"event": "checkpoint", "time": 100},  # killed
              {"event": "requeue", "time": 130, "exit_code": 137},
              {"event": "phase", "time": 200, "phase": "process_start"},
              {"event": "health", "time": 205, "ok": True},
              {"event": "checkpoint_recovered", "time": 206},
              {"event": "error", "time": 207, "message": "data missing"},  # refused start
              {"event": "phase", "time": 300, "phase": "process_start"},
              {"event": "health", "time": 305, "ok": True},
              {"event": "resume", "time": 310}, {"event": "finish", "time": 410}]
    assert iv.failures_seen(events) == (190.0, 1)


def test_the_tracker_waits_for_slow_saves_to_age_before_shortening():
    auto = iv.AutoInterval(mtbf_s=24 * HOUR, max_steps=10**6)
    auto.observe_step(1.0)
    auto.observe_stall(8.0)
    long = auto.propose()
    auto.observe_stall(0.5)  # one fast save
    assert auto.propose() < long and auto.stall_s == pytest.approx(6.4)


def test_auto_is_accepted_and_a_fixed_interval_stays_the_default():
    assert config.load(None).checkpoint.interval == 50
    cfg = config.load(None, ["checkpoint.interval=auto", "checkpoint.mtbf_hours=2"])
    assert iv.for_config(cfg.checkpoint.interval, 2.0, 1000, [])[0] == iv.FIRST_STEPS
    assert config.load(None, ["checkpoint.interval=7"]).checkpoint.interval == 7
    with pytest.raises(config.ConfigError, match="an integer >= 1 or auto"):
        config.load(None, ["checkpoint.interval=often"])


def test_a_killed_attempt_was_observed_until_its_last_metrics_row_not_its_last_event():
    # Killed 55 minutes after its newest checkpoint: its events end at 600 s, its metrics go on.
    events = [{"event": "start", "time": 0}, {"event": "checkpoint", "time": 600},
              {"event": "resume", "time": 4000}, {"event": "finish", "time": 4100}]
    metrics = [{"step": s, "time": t} for s, t in ((10, 300), (20, 3900), (30, 4050))]
    assert iv.failures_seen(events, metrics) == (3900 + 100, 1)


def test_records_without_a_numeric_time_are_left_out_of_the_failures():
    # A hand-edited line used to stop the start of an `auto` run with a ValueError.
    events = [{"event": "start", "time": 0}, {"event": "checkpoint", "time": "soon"},
              {"event": "stop", "time": 50, "reason": "deadline"},
              {"event": "resume", "time": None},
              {"event": "resume", "time": 100}, {"event": "finish", "time": float("nan")},
              {"event": "finish", "time": 150}]
    assert iv.failures_seen(events) == (100, 0)


def test_the_next_save_is_due_counted_from_the_newest_save_s_start_and_steps_exclude_stalls():
    auto = iv.AutoInterval(mtbf_s=3600.0, max_steps=1000)
    assert not auto.due(5, 2)  # no first step yet
    auto.begin(iv.Clock(step=1, time=10.0, stall=0.0))
    auto.begin(iv.Clock(step=2, time=11.0, stall=0.0))  # only the attempt's first counts
    assert [auto.due(s, 4) for s in (4, 5)] == [False, True]
    since, clock = auto.started(iv.Clock(step=5, time=14.5, stall=0.5))
    assert since == iv.Clock(1, 10.0, 0.0) and auto.clock == clock
    assert not auto.due(6, 4)  # the save of step 5 may still be writing: not due again
    auto.observe_steps(since, clock)  # 4 steps in 4.5 s, of which 0.5 s were a save's stall
    assert auto.step_s == pytest.approx(1.0)
