"""The worker's readiness loop: one ``select.epoll`` over its control socket, its direct
listeners and its direct connections, each fd with the handler of its events.

``selectors`` wraps epoll in a key object, a dict lookup and a mask translation per event
and per turn (≈ 3-5 µs a turn on the worker's one-connection path); the worker turns its
loop once per call, so it uses epoll as it is: fds registered once, their interest
modified only when it changes, and ``poll``'s ``(fd, events)`` dispatched through one
dict.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable

# A handler is told the epoll event mask of its fd's events (an error or hang-up counts as
# both readable and writable, as with ``selectors``: the read or write then says what happened)
READABLE = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
WRITABLE = select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP

Handler = Callable[[int], None]


class Poller:
    """An epoll set and the handler of each fd in it (None: the loop's own, e.g. the control
    socket, which the loop looks for itself)."""

    def __init__(self) -> None:
        self.ep = select.epoll()
        self.handlers: dict[int, Handler | None] = {}
        self.busy = False  # the last wait's poll ended because a task waited for a CPU

    def register(self, fd: int, events: int, handler: Handler | None) -> None:
        """Watch ``fd`` for ``events`` (``select.EPOLLIN`` / ``EPOLLOUT``)."""
        self.ep.register(fd, events)
        self.handlers[fd] = handler

    def modify(self, fd: int, events: int) -> None:
        self.ep.modify(fd, events)

    def unregister(self, fd: int) -> None:
        """Stop watching ``fd`` (before it is closed); one not watched is ignored."""
        if fd in self.handlers:
            del self.handlers[fd]
            self.ep.unregister(fd)

    def wait(self, timeout: float | None, spin_ns: int,
             cpu_free: Callable[[int], bool] | None = None) -> list[tuple[int, int]]:
        """The events of the next ``timeout`` seconds (None: until one comes): polled for
        without sleeping for the first ``spin_ns``, then waited for in ``epoll_wait``. The
        poll ends early once ``cpu_free(now_ns)`` says a task waits for a CPU (it is asked
        at every try; ``spin.HostLoad`` reads the host at most every 10 µs); ``busy`` then
        says so."""
        self.busy = False
        if timeout is not None:
            spin_ns = min(spin_ns, int(timeout * 1e9))
        if spin_ns:
            poll, clock, give_way = self.ep.poll, time.monotonic_ns, os.sched_yield
            start = clock()
            end = now = start + spin_ns
            while True:
                events = poll(0)
                now = clock()
                if events or now >= end:
                    break
                if cpu_free is not None and not cpu_free(now):
                    self.busy = True
                    break
                give_way()
            if events:
                return events
            if timeout is not None:
                timeout = max(0.0, timeout - (now - start) / 1e9)
        return self.ep.poll(timeout)

    def close(self) -> None:
        self.ep.close()
        self.handlers.clear()
