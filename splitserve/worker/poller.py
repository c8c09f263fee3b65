"""The worker's readiness loop: one ``select.epoll`` over its control socket, its direct
listeners and its direct connections, each fd with the handler of its events.

``selectors`` wraps epoll in a key object, a dict lookup and a mask translation per event
and per turn (≈ 3-5 µs a turn on the worker's one-connection path); the worker turns its
loop once per call, so it uses epoll as it is: fds registered once, their interest
modified only when it changes, and ``poll``'s ``(fd, events)`` dispatched through one
dict.
"""

from __future__ import annotations

import select
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

    def close(self) -> None:
        self.ep.close()
        self.handlers.clear()
