"""Stop decisions: signals only set a flag; the deadline keeps room for steps and a save."""

from __future__ import annotations

import os
import signal

import pytest

from pyrecover.preempt import Deadline, StopFlag, job_end_time, parse_signal


@pytest.mark.parametrize("name, sig", [("USR2", signal.SIGUSR2), ("SIGTERM", signal.SIGTERM),
                                       ("usr1", signal.SIGUSR1), ("15", signal.SIGTERM)])
def test_signal_names_are_read_with_or_without_sig(name, sig):
    assert parse_signal(name) == sig


def test_an_unknown_signal_is_an_error():
    with pytest.raises(ValueError, match="unknown signal 'USR9'"):
        parse_signal("USR9")


def test_a_signal_only_sets_the_flag_and_the_first_one_wins():
    flag = StopFlag().install(("USR2", "TERM"))
    try:
        assert flag.reason is None
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.reason == "SIGUSR2"
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


@pytest.mark.parametrize("environ, end", [
    ({}, None),
    ({"SLURM_JOB_END_TIME": "1700000000"}, 1700000000.0),
    ({"PYRECOVER_JOB_END_TIME": "1700000123"}, 1700000123.0),
    ({"SLURM_JOB_END_TIME": "0", "PYRECOVER_JOB_END_TIME": "5"}, 5.0),
    ({"PYRECOVER_JOB_END_TIME": "Unknown"}, None),
])
def test_the_job_end_comes_from_slurm_or_the_job_script(environ, end):
    assert job_end_time(environ) == end


def test_the_deadline_stops_when_two_steps_and_a_save_no_longer_fit():
    d = Deadline(end_time=1000.0, margin_s=10, steps_ahead=2)
    d.observe(step_s=5.0, save_s=20.0)
    assert not d.must_stop(now=959.0)  # 959 + 2*5 + 20 + 10 = 999
    assert d.must_stop(now=960.0)


def test_without_an_end_time_the_deadline_never_stops():
    d = Deadline(end_time=None)
    d.observe(1e6, 1e6)
    assert not d.must_stop(now=1e12)


def test_one_slow_step_is_forgotten_slowly_not_at_once():
    d = Deadline(end_time=None)
    d.observe(10.0)
    for _ in range(10):
        d.observe(1.0)
    assert 1.0 < d.step_s < 10.0


def test_a_signal_caught_before_the_run_has_its_flag_is_the_runs_and_handlers_come_back():
    from pyrecover import preempt

    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    preempt.catch_early()
    preempt.catch_early()  # (idempotent: the console script's entry calls it again)
    os.kill(os.getpid(), signal.SIGUSR2)  # during the imports, the data, the health check
    assert preempt.caught_early() == signal.SIGUSR2
    flag = preempt.take_over(("USR2", "SIGTERM"))
    assert flag.reason == "SIGUSR2" and flag.received_at is not None
    assert preempt.caught_early() is None
    assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]  # not this run's
    flag.uninstall()
    assert {s: signal.getsignal(s) for s in before} == before
    assert preempt.take_over(("USR2",)).reason is None  # nothing caught early: a plain flag


def test_an_early_signal_the_run_does_not_stop_on_ends_it_as_it_always_did(tmp_path):
    # A run that stops on USR2 got USR1 during start-up: the default action, once handed on.
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from pyrecover import preempt\n"
            "preempt.catch_early()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "print('caught', flush=True)\n"
            "preempt.take_over(('USR2', 'SIGTERM'))\n"
            "time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGUSR1 and done.stdout == "caught\n", done.stderr


def test_a_first_ctrl_c_stops_cleanly_and_a_second_one_quits_at_once():
    flag = StopFlag().install(("USR2", "SIGINT"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.reason == "SIGINT"
        os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, reaching the process twice
        assert flag.reason == "SIGINT"
        flag.received_at -= 2.0  # a second press, later
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        flag.uninstall()
    usr2 = StopFlag().install(("USR2", "SIGINT"))
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # a preemption's stop under way
        with pytest.raises(KeyboardInterrupt):  # and the user wants out now
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        usr2.uninstall()


def test_the_launcher_asks_its_terminal_not_its_stderr_whether_a_ctrl_c_reached_the_workers():
    """`pyrecover train --nproc 2 2>&1 | tee log`: stderr is a pipe, yet the terminal's
    Ctrl-C reaches the whole foreground group. Asked of stderr, the launcher handed on a
    second SIGINT, which a worker a second later takes for "quit at once"."""
    import fcntl
    import subprocess
    import sys
    import termios

    probe = "from pyrecover.spawn import terminal_sent_it; print(terminal_sent_it())"
    master, slave = os.openpty()

    def controlling_terminal() -> None:  # a new session, the pty its terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        at_terminal = subprocess.run([sys.executable, "-c", probe], stdin=slave,
                                     capture_output=True, text=True, timeout=120,
                                     start_new_session=True, preexec_fn=controlling_terminal)
    finally:
        os.close(slave)
        os.close(master)
    alone = subprocess.run([sys.executable, "-c", probe], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=120, start_new_session=True)
    assert (at_terminal.stdout, alone.stdout) == ("True\n", "False\n"), (at_terminal, alone)


@pytest.mark.parametrize("stop", ["USR1", "USR2", "TERM", "HUP", "XCPU"])
def test_every_stop_signal_a_run_may_name_is_caught_from_the_start_and_is_the_runs(stop):
    """run.stop_signal HUP or XCPU reaching a trainer before it read its config ended it
    (the early catch knew only USR1, USR2 and TERM). INT is left out on purpose: a Ctrl-C
    during start-up quits at once."""
    import subprocess
    import sys

    from pyrecover.config import load

    load(None, [f"run.stop_signal={stop}"])  # a name the config accepts
    code = ("import os, signal\n"
            "from pyrecover import preempt\n"
            "preempt.catch_early()\n"
            f"os.kill(os.getpid(), signal.SIG{stop})\n"
            f"print(preempt.take_over(('{stop}', 'SIGTERM', 'SIGINT')).reason, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout) == (0, f"SIG{stop}\n"), done.stderr


def test_a_launcher_that_hands_its_stop_signals_on_gives_the_early_catch_of_others_back():
    """`train --nproc N` handles the signals it hands on itself and never takes over a run's
    flag: the early catch of the others (HUP for a run that stops on USR2) must end there
    too, or that signal would be swallowed for the whole run."""
    from pyrecover import preempt

    others = (signal.SIGHUP, signal.SIGXCPU, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in (*others, signal.SIGUSR2)}
    preempt.catch_early()
    os.kill(os.getpid(), signal.SIGUSR2)  # before the launcher handled it: caught early
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # the launcher's own handler
    try:
        caught, at, handlers = preempt.end_early((signal.SIGUSR2,))
        assert caught == signal.SIGUSR2 and at is not None  # the launcher's to hand on
        assert preempt.caught_early() is None
        assert {s: signal.getsignal(s) for s in others} == {s: before[s] for s in others}
        assert handlers == {signal.SIGUSR2: before[signal.SIGUSR2]}  # what it restores
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN  # the launcher's stays
        assert preempt.end_early((signal.SIGUSR2,)) == (None, None, {})  # once only
    finally:
        signal.signal(signal.SIGUSR2, before[signal.SIGUSR2])
