"""The hang watchdog's timeout rule and its phase tracking, on a fake clock."""

from __future__ import annotations

import threading

import pytest

from pyrecover import config, watchdog
from pyrecover.config import ConfigError
from pyrecover.watchdog import Rule, Watchdog, limit


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeIO:
    """Stands in for /proc/self/io: the bytes the process read and wrote."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count


def dog(rule: Rule) -> tuple[Watchdog, FakeClock, FakeIO]:
    clock, io = FakeClock(), FakeIO()
    return Watchdog(rule, rank=3, node="node7", clock=clock, progress=io), clock, io


def run_step(d: Watchdog, clock: FakeClock, step: int, seconds: float) -> None:
    d.phase("data", step)
    clock.now += seconds / 2
    d.phase("forward")
    clock.now += seconds / 2
    d.step_done()


def test_the_auto_limit_is_a_multiple_of_the_slowest_step_within_floor_and_ceiling():
    rule = Rule(startup=900)
    assert limit(rule, "forward", steps_done=5, slowest_step=0.1) == 60  # the floor
    assert limit(rule, "forward", steps_done=5, slowest_step=12) == 120
    assert limit(rule, "forward", steps_done=5, slowest_step=100) == 600  # the ceiling
    assert limit(Rule(fixed=7), "backward", steps_done=5, slowest_step=100) == 7


def test_the_first_step_a_load_and_a_save_get_the_startup_limit():
    rule = Rule(fixed=5, startup=300)
    assert limit(rule, "forward", steps_done=0, slowest_step=0) == 300
    assert limit(rule, "load", steps_done=0, slowest_step=0) == 300
    assert limit(rule, "checkpoint", steps_done=40, slowest_step=1) == 300


def test_a_normal_step_phase_fires_just_after_its_limit_naming_rank_node_phase_and_step():
    d, clock, _ = dog(Rule(fixed=5, startup=300))
    run_step(d, clock, 1, 2.0)
    d.phase("data", 2)
    d.phase("allreduce")
    clock.now += 5.0
    assert d.check() is None
    clock.now += 0.1
    hang = d.check()
    assert hang is not None
    assert (hang.rank, hang.node, hang.phase, hang.step) == (3, "node7", "allreduce", 2)
    assert hang.limit == 5


def test_the_first_step_does_not_fire_at_the_normal_limit():
    d, clock, _ = dog(Rule(fixed=5, startup=300))
    d.phase("data", 1)
    d.phase("forward")
    clock.now += 200  # compilation, process group warm-up
    assert d.check() is None
    clock.now += 101
    assert d.check().phase == "forward"


def test_a_long_save_that_keeps_writing_never_fires_and_a_stalled_one_does():
    d, clock, io = dog(Rule(fixed=5, startup=60))
    run_step(d, clock, 1, 1.0)
    run_step(d, clock, 2, 1.0)
    d.phase("checkpoint")
    for _ in range(100):  # 1000 s of saving, bytes written every 10 s
        clock.now += 10
        io.count += 1 << 20
        assert d.check() is None
    clock.now += 60
    assert d.check() is None
    clock.now += 1
    hang = d.check()
    assert hang.phase == "checkpoint" and hang.seconds == 61


def test_start_up_that_keeps_reading_never_fires_and_a_stalled_one_does():
    # Rank 0 tidies before the model is built: it checksums the survivors' snapshot, which
    # for a large state reads for longer than the startup limit.
    d, clock, io = dog(Rule(fixed=5, startup=60))
    for _ in range(100):  # 1000 s of reading, bytes read every 10 s
        clock.now += 10
        io.count += 8 << 20
        assert d.check() is None
    clock.now += 61
    assert d.check().phase == "setup"


def test_a_load_waiting_on_rank_0_fires_only_after_the_startup_limit():
    d, clock, _ = dog(Rule(fixed=5, startup=120))
    d.phase("load")
    clock.now += 119
    assert d.check() is None
    clock.now += 2
    assert d.check().phase == "load"


def test_the_adaptive_limit_ignores_the_first_step_and_follows_the_slowest_later_one():
    d, clock, _ = dog(Rule(startup=900, floor=1, ceiling=100, factor=10))
    run_step(d, clock, 1, 50.0)  # compilation: not a measure of a step
    assert d.slowest_step == 0
    run_step(d, clock, 2, 0.5)
    run_step(d, clock, 3, 0.8)
    run_step(d, clock, 4, 0.3)
    assert d.slowest_step == pytest.approx(0.8)
    d.phase("data", 5)
    d.phase("backward")
    clock.now += 8.0
    assert d.check() is None
    clock.now += 0.1
    assert d.check().limit == pytest.approx(8.0)


def test_own_compute_time_counts_only_the_phases_that_never_wait_on_a_peer():
    d, clock, _ = dog(Rule(fixed=5))
    d.phase("data", 1)
    clock.now += 0.1
    d.phase("forward")
    clock.now += 0.2
    d.phase("backward")
    clock.now += 3.0  # waiting in the gradient all-reduce for a slower peer
    d.phase("optimizer")
    clock.now += 0.1
    seconds, own = d.step_done()
    assert seconds == pytest.approx(3.4) and own == pytest.approx(0.3)


def test_off_and_idle_never_fire():
    d, clock, _ = dog(watchdog.rule_from("off", 10))
    d.phase("forward", 1)
    clock.now += 1e6
    assert d.check() is None
    d, clock, _ = dog(watchdog.rule_from("3", 10))
    d.phase("idle")
    clock.now += 1e6
    assert d.check() is None


def test_torch_timeout_is_set_above_every_limit_the_watchdog_can_give():
    for rule in (Rule(fixed=5, startup=900), Rule(startup=30), Rule(fixed=5000, startup=10)):
        biggest = max(limit(rule, p, n, s) for p in ("forward", "load", "checkpoint")
                      for n in (0, 9) for s in (0.0, 1e6))
        assert watchdog.backstop_seconds(rule) > biggest
    # Ranks waiting for rank 0's checksum pass or save do so inside a collective: torch's
    # timeout leaves room for one pass over the checkpoint on slow storage (1 TB: 10,000 s).
    rule = Rule()
    assert watchdog.backstop_seconds(rule, 10**12) == watchdog.backstop_seconds(rule) + 1e4


def test_the_thread_fires_once_and_hands_the_hang_to_its_handler():
    d, clock, _ = dog(Rule(fixed=1, startup=1))
    got: list[watchdog.Hang] = []
    called = threading.Event()
    d.on_hang, d.poll_s = (lambda h: (got.append(h), called.set())), 0.01
    d.phase("forward", 4)
    clock.now += 5
    d.start()
    assert called.wait(30)
    d.stop()
    assert d.fired.is_set() and [h.phase for h in got] == ["forward"]


@pytest.mark.parametrize("key,value", [("run.hang_timeout", "soon"), ("run.hang_timeout", "-3"),
                                       ("run.hang_startup_timeout", 0),
                                       ("run.straggler_factor", 1.0),
                                       ("run.straggler_windows", 0)])
def test_bad_watchdog_settings_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config.from_dict({"run": {key.split(".")[1]: value}})


def test_hang_timeout_takes_seconds_auto_or_off():
    for text in ("auto", "off", "30", "2.5"):
        config.from_dict({"run": {"hang_timeout": text}})
    assert config.from_dict({"run": {"hang_timeout": 45}}).run.hang_timeout == "45"


def test_saving_bytes_counts_the_checkpoints_being_written_not_the_committed_ones(tmp_path):
    assert watchdog.saving_bytes(tmp_path / "absent") == -1
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / "model.pt").write_bytes(bytes(100))
    assert watchdog.saving_bytes(tmp_path) == 0
    (tmp_path / ".tmp-step-20-abc").mkdir()
    (tmp_path / ".tmp-step-20-abc" / "part").write_bytes(bytes(7))
    (tmp_path / ".snap-step-19").mkdir()
    (tmp_path / ".snap-step-19" / "part").write_bytes(bytes(5))
    assert watchdog.saving_bytes(tmp_path) == 12


def test_io_bytes_does_not_count_its_own_reading_as_progress(tmp_path):
    before = watchdog.io_bytes()
    assert all(watchdog.io_bytes() == before for _ in range(20))
    with open(tmp_path / "f", "wb") as f:
        f.write(bytes(5000))
    assert watchdog.io_bytes() >= before + 5000
