"""How many threads PyTorch's CPU work uses, adapted to what else runs on the machine.

PyTorch's CPU build runs each parallel operator on a team of OpenMP threads, one per core
by default, and the team waits at a barrier after every operator. On a quiet machine that
is the fastest setting. When another process keeps a core busy (a browser showing the demo,
a build, another model), one of the team's threads loses whole scheduler time slices and
the rest of the team waits for it at every barrier: measured on 2 cores, one PushT stream
fell from real time to a chunk every 5 s, while a single thread kept real time
(docs/benchmarks.md, "CPU threads next to other work").

`ThreadGovernor` watches how much CPU the machine's other processes use (Linux
`/proc/stat`, minus this process's own CPU time) and sets PyTorch's thread count to the
cores left over: all of them while the machine is quiet, fewer while others are busy. It
steps down after `down_after` samples that ask for fewer threads and up after `up_after`
samples that allow more (quick to yield, slow to take back). `streamworld serve` runs one
on a CPU unless `--threads` fixes the count. Where `/proc/stat` does not exist (macOS,
Windows) the governor does not start and PyTorch's default stands.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

PROC_STAT = "/proc/stat"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the system reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def machine_busy_seconds(path: str = PROC_STAT) -> float | None:
    """CPU seconds all processes have used since boot (all cores), or None without /proc."""
    try:
        with open(path, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user)
    ticks = [int(v) for v in fields[1:9]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class ThreadPolicy:
    """The decision alone, fed one sample at a time (tests drive it with made-up samples)."""

    cores: int
    threads: int  # the count in force
    margin: float = 0.25  # cores: others' use below cores - threads + margin still allows `threads`
    down_after: int = 2  # samples asking for fewer threads before stepping down
    up_after: int = 5  # samples allowing more threads before stepping up
    _down: int = field(default=0, init=False, repr=False)
    _up: int = field(default=0, init=False, repr=False)

    def wanted(self, others: float) -> int:
        """Threads that fit beside `others` cores of other processes' work."""
        return max(1, min(self.cores, int(self.cores - others + self.margin)))

    def observe(self, others: float) -> int | None:
        """One sample of other processes' CPU use, in cores; the new count, or None to keep."""
        want = self.wanted(others)
        self._down = self._down + 1 if want < self.threads else 0
        self._up = self._up + 1 if want > self.threads else 0
        if self._down >= self.down_after or self._up >= self.up_after:
            self._down = self._up = 0
            self.threads = want
            return want
        return None


class ThreadGovernor:
    """Samples the machine every `interval_s` on a daemon thread and applies the policy's
    changes through `apply(threads)` (which must run `torch.set_num_threads` where the
    process does its PyTorch CPU work; where it queues the change and returns a Future,
    `stop` waits for the last one)."""

    def __init__(
        self,
        apply: Callable[[int], object],
        cores: int | None = None,
        interval_s: float = 1.0,
        read_machine: Callable[[], float | None] = machine_busy_seconds,
        read_own: Callable[[], float] = time.process_time,
        read_threads: Callable[[], int] | None = None,
    ) -> None:
        self.cores = cores or usable_cores()
        self.policy = ThreadPolicy(self.cores, threads=self.cores)
        self.apply = apply
        self.interval_s = interval_s
        self.read_machine = read_machine
        self.read_own = read_own
        # The count in force before `start`, read with `read_threads`; `stop` puts it back.
        self.read_threads = read_threads
        self._before: int | None = None
        # The latest changes: (monotonic time, threads, others' cores).
        self.changes: deque[tuple[float, int, float]] = deque(maxlen=64)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, float, float] | None = None  # wall, machine busy, own

    @property
    def threads(self) -> int:
        return self.policy.threads

    def available(self) -> bool:
        return self.read_machine() is not None

    def start(self) -> ThreadGovernor:
        self._before = self.read_threads() if self.read_threads is not None else None
        self.apply(self.cores)
        self._thread = threading.Thread(target=self._run, name="streamworld-threads", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops sampling and puts back the thread count in force before `start`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._before is not None:
            done = self.apply(self._before)
            self._before = None
            # Wait for a queued change to run: a process that exits while PyTorch resizes its
            # thread pool on another thread aborts ("terminate called without an active
            # exception").
            if isinstance(done, Future):
                done.result(timeout=30)

    def sample(self) -> float | None:
        """Other processes' CPU use since the last sample, in cores (None on the first)."""
        now, machine, own = time.monotonic(), self.read_machine(), self.read_own()
        if machine is None:
            return None
        last, self._last = self._last, (now, machine, own)
        if last is None or now <= last[0]:
            return None
        others = ((machine - last[1]) - (own - last[2])) / (now - last[0])
        return min(float(self.cores), max(0.0, others))

    def step(self) -> None:
        others = self.sample()
        if others is None:
            return
        threads = self.policy.observe(others)
        if threads is not None:
            self.changes.append((time.monotonic(), threads, others))
            log.info(
                "other processes use %.1f of %d cores: PyTorch CPU threads -> %d", others, self.cores, threads
            )
            self.apply(threads)

    @classmethod
    def for_torch(cls, **kwargs) -> ThreadGovernor:
        """A governor that sets the thread count of the process's PyTorch CPU worker."""
        import torch

        from .executor import set_cpu_threads

        return cls(set_cpu_threads, read_threads=torch.get_num_threads, **kwargs)

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:  # a governor that fails leaves the count as it is
                log.exception("CPU thread governor stopped")
                return
