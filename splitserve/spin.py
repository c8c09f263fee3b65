"""How long a waiting side of a direct call polls before it sleeps.

Two sides of a direct call wait: the worker's loop for its next call, and a blocking
client for its answer. A side that sleeps (``epoll_wait``, a blocking ``recv``) pays a
wake-up when the event comes: the scheduler's, the hypervisor's where an idle vCPU halts
(on the 2-core VM a vCPU idle for more than ≈ 200 µs is descheduled by the host, and a
client that slept through a lenet call paid ≈ 70-80 µs to run again), and the caches that
went cold meanwhile. When the event comes soon, polling for it costs less than it saves;
when it does not, it is CPU burnt for nothing, and on a busy host it takes a core that
someone else is waiting for. So a side polls only

- while the recent waits (an EWMA, each counted at most ``_GAP_CAP`` budgets) are within
  its budget, or the last one was: a loop whose calls come seldom, or a client whose answers
  take longer than the budget, stops polling after a few misses and starts again at the first
  call that comes close (a worker whose client went away for a moment, e.g. to another model,
  pays one sleep when it comes back, not the EWMA's half-dozen); and
- while the host has no runnable task waiting for a CPU (``/proc/loadavg``'s runnable count
  at most the CPUs this process may use). The count is the scheduler's instantaneous
  ``nr_running``, read through a descriptor kept open (one ``pread``, ≈ 1 µs) at most every
  ``LOAD_PERIOD_NS`` (50 µs) while the host is free, also *during* a poll (``Poller.wait``,
  the compiled client wire), whose first look reads at once: the first read that finds a
  task waiting ends the poll under way and makes the next wait sleep. A poll for a short
  wait (a small model's answer, ≈ 40 µs) is over before a second look, so a rule that asked
  for two such reads in a row let it spin through the whole wait on a busy host, on the core
  its peer needed. Only ``BUSY_READS`` reads in a row hold the verdict for ``BUSY_HOLD_NS``
  before the host is read again (a kernel thread seen runnable once is a moment: the next
  wait reads again); on a host whose cores are taken, a side that looked again at every wait
  would spend a read per call finding the same thing.

``SpinPolicy`` decides from the waits and the host's state it is told (a pure decider);
``HostLoad`` reads the host. The worker's loop uses them through ``Poller.wait``
(``ServerConfig.transports.direct_spin_us``), the blocking client through its wire's ``call``
(``Client(poll_us=...)``); both look at the host during the poll too, the compiled wire
with ``HostLoad.poll_check``'s descriptor and rule.
"""

from __future__ import annotations

import os

_GAP_CAP = 4  # an idle stretch counts as this many budgets: a few close calls bring the poll back
_ALPHA = 0.25  # the EWMA's weight of the newest gap
LOAD_PERIOD_NS = 50_000  # how often HostLoad reads /proc/loadavg while the host is free
BUSY_READS = 2  # reads in a row that find a task waiting for a CPU before the busy verdict holds
# how long a busy verdict holds before the host is read again: one read then re-confirms it (≈ 1 µs
# per hold on a busy host), while a longer hold made a moment of contention (a side polling while
# two others ran) cost every call of the next 20 ms its poll, on both sides of a direct call
BUSY_HOLD_NS = 250_000


class SpinPolicy:
    """The poll window before each sleep: ``budget_ns`` while the recent waits, or the last
    one, are within it and a CPU is free, else 0 (sleep at once)."""

    def __init__(self, budget_ns: int) -> None:
        if budget_ns < 0:
            raise ValueError("a spin budget is 0 (off) or a positive number of ns")
        self.budget_ns = budget_ns
        self.gap_ns = 0.0  # no gap seen yet: poll, and learn
        self.last_ns = 0  # the last wait, capped as the EWMA's are

    def window_ns(self, cpu_free: bool) -> int:
        """How long to poll before sleeping now."""
        budget = self.budget_ns
        if not budget or not cpu_free or (self.gap_ns > budget and self.last_ns > budget):
            return 0
        return budget

    def observe(self, gap_ns: int) -> None:
        """A wait ended ``gap_ns`` after it began (by an event or its timeout)."""
        if self.budget_ns:
            gap = self.last_ns = min(gap_ns, _GAP_CAP * self.budget_ns)
            self.gap_ns += _ALPHA * (gap - self.gap_ns)


def cpu_free(loadavg: str, cpus: int) -> bool:
    """No runnable task waits for a CPU: ``/proc/loadavg``'s fourth field (runnable/total,
    the reader itself among the runnable) at most the online CPUs."""
    try:
        return int(loadavg.split()[3].split("/")[0]) <= cpus
    except (IndexError, ValueError):
        return False


class HostLoad:
    """Whether the host has a CPU free, read from ``/proc/loadavg`` at most every
    ``LOAD_PERIOD_NS``: not once a read found a task waiting for one, and for
    ``BUSY_HOLD_NS`` after ``BUSY_READS`` such reads in a row (never where the file cannot
    be read)."""

    def __init__(self, path: str = "/proc/loadavg") -> None:
        self.path = path
        try:  # the CPUs this process may run on (a container's cpuset), not the machine's
            self.cpus = len(os.sched_getaffinity(0)) or 1
        except OSError:
            self.cpus = os.cpu_count() or 1
        self.read_at_ns = -LOAD_PERIOD_NS  # the first ask reads
        self.busy_reads = 0  # reads in a row that found a task waiting
        self.free = False
        self._fd = -1  # opened at the first read, kept: one pread per look, no open or close

    def _read(self) -> str:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(self._fd, 128, 0).decode("ascii", "replace")

    def cpu_free(self, now_ns: int) -> bool:
        if now_ns - self.read_at_ns >= LOAD_PERIOD_NS:
            try:
                busy = not cpu_free(self._read(), self.cpus)
            except OSError:
                busy, self.busy_reads = True, BUSY_READS
            self.busy_reads = self.busy_reads + 1 if busy else 0
            self.free = not busy
            # busy in a row: not read again for the hold (one period is already in read_at_ns's step)
            self.read_at_ns = now_ns + (0 if self.busy_reads < BUSY_READS else BUSY_HOLD_NS - LOAD_PERIOD_NS)
        return self.free

    def poll_check(self) -> tuple[int, int, float] | None:
        """What a compiled poll needs to watch the host as ``cpu_free`` does, without the
        GIL (``_fastwire.Wire.call``'s ``load``): the open ``/proc/loadavg`` descriptor,
        the CPUs and the read period (s); None before the first read opened it."""
        return None if self._fd < 0 else (self._fd, self.cpus, LOAD_PERIOD_NS / 1e9)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
