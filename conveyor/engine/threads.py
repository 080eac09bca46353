"""ThreadGovernor: the engine's CPU thread count follows the CPU the process actually gets.

A CPU step runs about 150 OpenMP parallel regions, and each ends at a barrier that waits for
every thread of the team. On a machine whose cores another busy process shares, the scheduler
often has one of the engine's threads off its core, and the others wait at every barrier for
it (libgomp spins for up to ~3 ms first, which also spends the engine's fair share): two busy
threads of another program cut a two-thread engine to a fifth of its speed, one thread to about
half of its own (docs/benchmarks.md, "Sharing the machine").

So the governor watches how long the engine's threads wait for a core: the kernel counts each
thread's time runnable but not running (/proc/self/task/*/schedstat, its second field). Over
each WINDOW seconds of step time it takes the compute threads' mean wait per second of steps
(wait_share). Above CONTENDED in two windows in a row, the engine drops to one thread (no
barrier to wait at). It tries its full count again after PROBE_FIRST seconds and keeps it if
the wait stays low; a failed probe doubles the next interval, up to PROBE_MAX. Every kernel
sums in a fixed order whatever the thread count (DESIGN.md: one reduction order per output
value), so answers do not change with it.

torch.set_num_threads acts on the calling thread's OpenMP team: after_step is called on the
thread that runs the steps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

WINDOW = 0.5  # seconds of step time per measurement
# The compute threads' wait for a core as a share of step time, in CONTENDED_WINDOWS windows in a
# row, that means contention: about 0.5 next to two busy threads on 2 cores, 0.00-0.06 alone
# (0.17 in a first window that overlaps the start's other work).
CONTENDED = 0.25
CONTENDED_WINDOWS = 2
PROBE_FIRST = 8.0  # seconds on one thread before the full count is tried again
PROBE_MAX = 64.0


def thread_times() -> dict[str, tuple[float, float]] | None:
    """Per thread of this process: (seconds on a core, seconds runnable but waiting for one);
    None where the kernel does not report them."""
    times = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as file:
                fields = file.read().split()
            times[tid] = (int(fields[0]) / 1e9, int(fields[1]) / 1e9)
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return times or None


def wait_share(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], busy: float
) -> float:
    """The compute threads' mean wait for a core per second of step time. A compute thread is
    one that was runnable (running or waiting) for at least half of the steps: the stepping
    thread and its OpenMP workers, not the tokenizer's or the sockets' threads."""
    waits = []
    for tid, (run, wait) in after.items():
        run0, wait0 = before.get(tid, (0.0, 0.0))
        if (run - run0) + (wait - wait0) >= 0.5 * busy:
            waits.append(wait - wait0)
    return sum(waits) / len(waits) / busy if waits else 0.0


class ThreadGovernor:
    def __init__(
        self,
        num_threads: int,
        read_times: Callable[[], dict | None] = thread_times,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.full = num_threads
        self.current = num_threads
        self._read_times, self._set_threads, self._clock = read_times, set_threads, clock
        self._busy = 0.0
        self._times = read_times()
        self._probe_interval = PROBE_FIRST
        self._next_probe: float | None = None  # on one thread: when to try the full count
        self._probing = False
        self._num_contended = 0  # windows in a row above CONTENDED
        self.last_share: float | None = None  # the last window's wait share (tests, logs)

    @classmethod
    def for_engine(cls, device: torch.device, tensor_parallel: bool) -> ThreadGovernor | None:
        """One for a CPU engine of more than one thread whose kernel reports run-queue waits;
        None otherwise (CUDA, tensor-parallel ranks, which share the cores by design)."""
        if device.type != "cpu" or tensor_parallel or torch.get_num_threads() < 2:
            return None
        if thread_times() is None:
            return None
        return cls(torch.get_num_threads())

    def after_step(self, seconds: float) -> None:
        """Called after each step with its duration; acts once per WINDOW of step time."""
        self._busy += seconds
        if self.current == 1 and not self._probing:
            if self._next_probe is not None and self._clock() >= self._next_probe:
                self._switch(self.full)
                self._probing = True
                self._restart()
            return
        if self._busy < WINDOW:
            return
        times = self._read_times()
        if times is None or self._times is None:
            return
        self.last_share = wait_share(self._times, times, self._busy)
        self._restart(times)
        contended = self.last_share > CONTENDED
        self._num_contended = self._num_contended + 1 if contended else 0
        if contended and (self._probing or self._num_contended >= CONTENDED_WINDOWS):
            self._to_one_thread()
        elif self._probing:
            logger.info("conveyor: the cores are free again: back to %d threads", self.full)
            self._probing, self._next_probe = False, None
            self._probe_interval = PROBE_FIRST

    def restore(self) -> None:
        """Back to the full count: an engine that ends in a process that goes on (the offline
        LLM, a test) leaves torch's thread count as it found it."""
        self._switch(self.full)
        self._probing, self._next_probe = False, None

    def _to_one_thread(self) -> None:
        if self._probing:
            self._probe_interval = min(self._probe_interval * 2, PROBE_MAX)
        else:
            logger.info(
                "conveyor: the engine's threads wait %.0f%% of each step for a core (another "
                "process is busy on them): running on 1 thread, trying %d again in %.0f s",
                100 * self.last_share,
                self.full,
                self._probe_interval,
            )
        self._probing, self._num_contended = False, 0
        self._switch(1)
        self._next_probe = self._clock() + self._probe_interval

    def _restart(self, times: dict | None = None) -> None:
        self._busy = 0.0
        self._times = self._read_times() if times is None else times

    def _switch(self, num_threads: int) -> None:
        if num_threads != self.current:
            self._set_threads(num_threads)
            self.current = num_threads
