"""The CPU thread governor: its policy on made-up samples, its sampling on fake clocks, and
the /proc/stat reader."""

from __future__ import annotations

import time

import pytest

from streamworld.engine.cpu_threads import ThreadGovernor, ThreadPolicy, machine_busy_seconds
from streamworld.engine.executor import _Worker


def test_the_policy_yields_cores_quickly_and_takes_them_back_slowly():
    policy = ThreadPolicy(cores=2, threads=2)
    assert policy.observe(0.1) is None  # a quiet machine keeps both threads
    assert policy.observe(0.6) is None  # one sample asking for fewer is not enough...
    assert policy.observe(0.1) is None  # ...and a quiet one after it starts the count again
    assert policy.observe(1.0) is None
    assert policy.observe(1.1) == 1  # two in a row step down
    for _ in range(4):  # the other process stops: four quiet samples are not enough...
        assert policy.observe(0.05) is None
    assert policy.observe(0.05) == 2  # ...the fifth steps up
    assert policy.threads == 2


def test_one_noisy_sample_does_not_flap():
    policy = ThreadPolicy(cores=4, threads=4)
    for others in (0.2, 2.5, 0.2, 2.5, 0.2):
        assert policy.observe(others) is None
    assert policy.threads == 4
    assert policy.wanted(2.5) == 1 and policy.wanted(1.5) == 2 and policy.wanted(4.0) == 1


class FakeMachine:
    def __init__(self) -> None:
        self.busy = 100.0  # CPU seconds of every process since boot
        self.own = 10.0  # CPU seconds of this process

    def run(self, own_cores: float, other_cores: float, seconds: float = 1.0) -> None:
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


def test_the_governor_counts_only_other_processes_and_applies_changes(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("streamworld.engine.cpu_threads.time.monotonic", lambda: clock[0])
    machine, applied = FakeMachine(), []
    governor = ThreadGovernor(
        applied.append, cores=2, read_machine=lambda: machine.busy, read_own=lambda: machine.own
    )
    assert governor.sample() is None  # the first sample only sets the baseline

    def second(own: float, others: float) -> None:
        machine.run(own, others)
        clock[0] += 1.0
        governor.step()

    second(own=2.0, others=0.0)  # this process alone, both cores busy: nothing to yield
    second(own=2.0, others=0.1)
    assert applied == [] and governor.threads == 2
    second(own=1.3, others=0.7)
    second(own=1.0, others=1.0)
    assert applied == [1] and governor.threads == 1
    assert governor.changes[-1][1:] == (1, pytest.approx(1.0))
    for _ in range(5):
        second(own=1.0, others=0.0)
    assert applied == [1, 2]


def test_machine_busy_seconds_reads_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 50 0 0 0 30 0\ncpu0 50 0 25 400 25 0 0 0 15 0\n")
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    assert machine_busy_seconds(str(stat)) == pytest.approx(150 / ticks)
    assert machine_busy_seconds(str(tmp_path / "missing")) is None


def test_the_governor_does_not_start_without_proc_stat():
    governor = ThreadGovernor(lambda n: None, cores=2, read_machine=lambda: None)
    assert not governor.available()


def test_stopping_the_governor_puts_back_the_thread_count_it_found():
    applied = []
    governor = ThreadGovernor(
        applied.append, cores=2, interval_s=60, read_machine=lambda: 0.0, read_threads=lambda: 1
    )
    governor.start()
    assert applied == [2] and governor._thread is not None and governor._thread.is_alive()
    thread = governor._thread
    governor.stop()
    assert applied == [2, 1] and not thread.is_alive()
    governor.stop()  # a second stop changes nothing
    assert applied == [2, 1]


def test_stopping_waits_for_a_queued_restore_to_run():
    # The real governor queues its changes on the CPU worker; a process that exits while that
    # change still runs can abort, so `stop` returns only once the restore has run.
    worker = _Worker("test-governor")
    applied = []

    def queue_change(threads: int):
        def change():
            time.sleep(0.2)
            applied.append(threads)

        return worker.submit(change)

    governor = ThreadGovernor(
        queue_change, cores=2, interval_s=60, read_machine=lambda: 0.0, read_threads=lambda: 1
    )
    governor.start()
    governor.stop()
    assert applied == [2, 1]
