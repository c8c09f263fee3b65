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
  ``LOAD_PERIOD_NS`` (10 µs), *during* a poll (``Poller.wait``, the compiled client wire,
  ``sockets.recv_polling``), whose first look, at its first try that finds nothing, reads
  at once; never before a wait, which that look would read again. ``BUSY_READS`` (2) reads
  in a row that find a task waiting end the poll under way, make the next wait sleep and
  hold that verdict for ``BUSY_HOLD_NS`` before the host is read again. One such read may be a kernel
  thread's moment, and a poll that looks every 10 µs through a lenet call's 300 µs has
  thirty chances to meet one on a quiet host. A peer being woken is not in the count
  until the CPU it goes to takes it in (an inter-processor interrupt away), so a first look
  can find the host free where it is not: looks 10 µs apart, not 50, catch it while a small
  model's 40 µs call still runs.
- while the last polls were not ended by a busy host. A side whose poll a busy host ended
  lets its waits go without a poll for a while
  (``BACKOFF_NS``, doubled while it lasts, at most ``BACKOFF_MAX_NS``), asking only the
  clock: on a 2-core host with the other core taken, a side that polls moves its peer's
  wake-ups to the other core, behind the task there, where without polling the two take
  turns on one core; and a side that asked the clock, the host and its policy at every
  call paid ≈ 3.5 µs a call for it (cold Python right after a wake-up), a tenth of a small
  model's calls/s. ``splitserve bench polling`` measures both sides on and off in the same
  minutes, on a quiet and on a busy host.

``SpinPolicy`` decides from the waits and how its polls ended (a pure decider);
``HostLoad`` reads the host. The worker's loop uses them through ``Poller.wait``
(``ServerConfig.transports.direct_spin_us``; after a front-end batch a policy of its own,
``front_end_spin_us``, with a ``HostLoad`` that takes ``BUSY_READS_AFTER_RUN`` reads to call
the host busy), the blocking client through its wire's ``call``
(``Client(poll_us=...)``); both look at the host during the poll too, the compiled wire
with ``HostLoad.poll_check``'s descriptor and rule.
"""

from __future__ import annotations

import os

_GAP_CAP = 4  # an idle stretch counts as this many budgets: a few close calls bring the poll back
_ALPHA = 0.25  # the EWMA's weight of the newest gap
LOAD_PERIOD_NS = 10_000  # how often HostLoad reads /proc/loadavg while the host is free (a poll's looks)
BUSY_READS = 2  # reads in a row that find a task waiting for a CPU before the busy verdict holds
# The same, for a worker's poll after a front-end batch (``ServerConfig.transports.front_end_spin_us``):
# on the front end's path the call's own three processes (client, front end, worker) meet on two
# cores for a moment at each hand-over, and two reads ended the worker's poll at every call; a
# task that keeps waiting (another process's work) ends it twelve reads (≈ 120 µs) in
BUSY_READS_AFTER_RUN = 12
# how long a busy verdict holds before the host is read again: one read then re-confirms it (≈ 1 µs
# per hold on a busy host), while a longer hold made a moment of contention (a side polling while
# two others ran) cost every call of the next 20 ms its poll, on both sides of a direct call
BUSY_HOLD_NS = 250_000
# A side whose poll a busy host ended lets its waits go without a poll for BACKOFF_NS, doubled
# while the polls it tries keep ending so, up to BACKOFF_MAX_NS (SpinPolicy): bounded in time,
# not in waits, so that a burst of contention (the front end's calls on the same cores) costs
# the direct calls after it at most that long.
BACKOFF_NS = 200_000
BACKOFF_MAX_NS = 6_400_000


class SpinPolicy:
    """The poll window before each sleep: ``budget_ns`` while the recent waits, or the last
    one, are within it, else 0 (sleep at once); the poll itself ends early on a busy host.

    A busy host makes the policy back off: a wait whose poll a busy host ended (no CPU was
    free from its first look, or its peer, once woken, found none), lets the waits of the next
    ``BACKOFF_NS`` go without a poll, then of twice that, ... up to ``BACKOFF_MAX_NS``, while
    the waits it tries keep finding it so; a poll that ends with its event resets it. A wait
    in a back-off asks nothing but the clock (``skipping``): on a 2-core host with the other
    core busy, a client that asked the clock, the host and the policy before each call and
    sent it plainly after all paid ≈ 3.5 µs a call for it (Python right after a wake-up runs
    cold), a tenth of a small model's calls/s."""

    def __init__(self, budget_ns: int) -> None:
        if budget_ns < 0:
            raise ValueError("a spin budget is 0 (off) or a positive number of ns")
        self.budget_ns = budget_ns
        self.gap_ns = 0.0  # no gap seen yet: poll, and learn
        self.last_ns = 0  # the last wait, capped as the EWMA's are
        self.backoff_ns = 0  # the last back-off's length (doubled at the next)
        self.quiet_at_ns = 0  # waits before this time go without a poll

    def skipping(self, now_ns: int) -> bool:
        """Whether a wait that begins at ``now_ns`` goes without a poll, the host unasked
        and the wait untimed: the policy backs off a busy host."""
        return now_ns < self.quiet_at_ns

    def window_ns(self) -> int:
        """How long the next wait polls before it sleeps, as the waits say. The host is not
        asked here: the poll looks at it at its first try that finds nothing (``HostLoad``,
        the compiled wire), and one that a busy host ends backs the policy off
        (``observe``). A look before the wait as well cost a blocking client ≈ 4 µs a call
        (a read of ``/proc/loadavg`` in Python right after a wake-up), a tenth of a small
        model's direct tax, and side by side a busy host cost no more without it
        (``docs/fastpath-breakdown.md``, stop 42)."""
        budget = self.budget_ns
        if not budget or (self.gap_ns > budget and self.last_ns > budget):
            return 0
        return budget

    def observe(self, gap_ns: int, busy: bool | None = None, now_ns: int = 0) -> None:
        """A wait ended ``gap_ns`` after it began (by an event or its timeout), at
        ``now_ns``. ``busy``: None where it did not poll, else whether a busy host ended its
        poll."""
        if self.budget_ns:
            gap = self.last_ns = min(gap_ns, _GAP_CAP * self.budget_ns)
            self.gap_ns += _ALPHA * (gap - self.gap_ns)
            if busy:
                self._back_off(now_ns)
            elif busy is not None:
                self.backoff_ns = 0

    def _back_off(self, now_ns: int) -> None:
        self.backoff_ns = min(2 * self.backoff_ns or BACKOFF_NS, BACKOFF_MAX_NS)
        self.quiet_at_ns = now_ns + self.backoff_ns


def cpu_free(loadavg: str, cpus: int) -> bool:
    """No runnable task waits for a CPU: ``/proc/loadavg``'s fourth field (runnable/total,
    the reader itself among the runnable) at most the online CPUs."""
    try:
        return int(loadavg.split()[3].split("/")[0]) <= cpus
    except (IndexError, ValueError):
        return False


class HostLoad:
    """Whether the host has a CPU free, read from ``/proc/loadavg`` at most every
    ``LOAD_PERIOD_NS``: not once ``busy_reads`` (default ``BUSY_READS``) reads in a row found
    a task waiting for one, and then not for ``BUSY_HOLD_NS`` (one read at its end that finds
    a task waiting again holds it again; never free where the file cannot be read)."""

    def __init__(self, path: str = "/proc/loadavg", busy_reads: int = BUSY_READS) -> None:
        if busy_reads < 1:
            raise ValueError("a busy verdict takes at least one read")
        self.path = path
        self.busy_reads_needed = busy_reads
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

    def readable(self) -> bool:
        """Open the file now; False where it cannot be read (a side that cannot watch the
        host must not poll: nothing would end its poll on a busy one)."""
        try:
            self._read()
        except OSError:
            return False
        return True

    def cpu_free(self, now_ns: int) -> bool:
        if now_ns - self.read_at_ns >= LOAD_PERIOD_NS:
            try:
                busy = not cpu_free(self._read(), self.cpus)
            except OSError:
                busy, self.busy_reads = True, self.busy_reads_needed
            self.busy_reads = self.busy_reads + 1 if busy else 0
            self.free = self.busy_reads < self.busy_reads_needed
            # busy in a row: not read again for the hold (one period is already in read_at_ns's step)
            self.read_at_ns = now_ns + (0 if self.free else BUSY_HOLD_NS - LOAD_PERIOD_NS)
        return self.free

    def poll_check(self) -> tuple[int, int, float, int] | None:
        """What a compiled poll needs to watch the host as ``cpu_free`` does, without the
        GIL (``_fastwire.Wire.call``'s ``load``): the open ``/proc/loadavg`` descriptor,
        the CPUs, the read period (s) and the busy reads in a row that end a poll; None
        before a read (or ``readable``) opened it."""
        return None if self._fd < 0 else (self._fd, self.cpus, LOAD_PERIOD_NS / 1e9, self.busy_reads_needed)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
