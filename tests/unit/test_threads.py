"""The thread governor: one thread while the compute threads wait for a core, all of them again
once a probe finds the cores free; and the kernel's per-thread counts it reads."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conveyor.engine import threads
from conveyor.engine.threads import ThreadGovernor, thread_times, wait_share


class Machine:
    """Per-thread (run, wait) seconds as the kernel would count them for two compute threads
    and an idle one, advanced step by step at a chosen wait share; and a clock."""

    def __init__(self) -> None:
        self.times = {"1": (0.0, 0.0), "2": (0.0, 0.0), "idle": (0.0, 0.0)}
        self.now = 0.0
        self.calls: list[int] = []

    def step(self, governor: ThreadGovernor, seconds: float, share: float) -> None:
        for tid in ("1", "2")[: governor.current]:
            run, wait = self.times[tid]
            self.times[tid] = (run + seconds * (1 - share), wait + seconds * share)
        self.now += seconds
        governor.after_step(seconds)

    def governor(self) -> ThreadGovernor:
        return ThreadGovernor(2, lambda: dict(self.times), self.calls.append, lambda: self.now)


def run(machine: Machine, governor: ThreadGovernor, seconds: float, share: float) -> None:
    for _ in range(round(seconds / 0.05)):
        machine.step(governor, 0.05, share)


def test_a_quiet_machine_keeps_every_thread():
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, 5.0, 0.02)
    assert governor.current == 2 and machine.calls == []


def test_one_busy_window_alone_changes_nothing():
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, threads.WINDOW, 0.5)  # the start's own work, say
    run(machine, governor, 3.0, 0.01)
    assert governor.current == 2 and machine.calls == []


def test_waiting_for_a_core_drops_to_one_thread_and_a_probe_restores_them():
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, 2 * threads.WINDOW + 0.1, 0.5)
    assert governor.current == 1 and machine.calls == [1]
    run(machine, governor, threads.PROBE_FIRST - 2.0, 0.3)  # no probe before its time
    assert machine.calls == [1]
    run(machine, governor, 3.0, 0.5)  # the probe finds them still busy: one thread again
    assert machine.calls == [1, 2, 1]
    run(machine, governor, 2 * threads.PROBE_FIRST + 1.0, 0.0)  # the next, twice as late
    assert machine.calls[-1] == 2 and governor.current == 2
    run(machine, governor, 5.0, 0.0)  # free: it stays
    assert governor.current == 2 and machine.calls == [1, 2, 1, 2]


def test_wait_share_counts_only_threads_that_ran_the_steps():
    before = {"a": (0.0, 0.0), "b": (0.0, 0.0), "tokenizer": (0.0, 0.0)}
    after = {"a": (0.5, 0.5), "b": (0.9, 0.1), "tokenizer": (0.01, 0.2), "new": (0.0, 0.0)}
    assert wait_share(before, after, 1.0) == pytest.approx(0.3)


def test_the_kernel_counts_a_busy_threads_time_on_a_core():
    first = thread_times()
    if first is None:
        pytest.skip("this kernel does not report per-thread scheduling statistics")

    # The thread spins until its times are read: a loaded machine may keep this one off a core
    # for longer than any fixed spin (a 0.3 s spin once ended before a 0.15 s sleep did).
    read = threading.Event()

    def spin() -> None:
        while not read.is_set():
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    time.sleep(0.15)
    during = thread_times()
    read.set()
    worker.join()
    # The new thread is found as the one /proc did not list before, not by its native id: where
    # /proc is mounted from another PID namespace (a CI sandbox), the two numberings differ.
    new = [run + wait for tid, (run, wait) in during.items() if tid not in first]
    assert new and max(new) >= 0.05


def test_an_engine_on_cpu_with_two_threads_has_a_governor():
    if torch.get_num_threads() < 2 or thread_times() is None:
        pytest.skip("one thread, or no per-thread scheduling statistics")
    assert ThreadGovernor.for_engine(torch.device("cpu"), tensor_parallel=False) is not None
    assert ThreadGovernor.for_engine(torch.device("cpu"), tensor_parallel=True) is None


def test_an_engine_that_ends_gives_back_the_threads_it_took():
    """A contended engine runs on one thread; when it closes (an offline LLM, a test), the
    process gets its full count back."""
    machine = Machine()
    governor = machine.governor()
    run(machine, governor, 1.5, share=0.5)
    assert governor.current == 1 and machine.calls == [1]
    governor.restore()
    assert governor.current == 2 and machine.calls == [1, 2]
    governor.restore()  # idempotent
    assert machine.calls == [1, 2]
