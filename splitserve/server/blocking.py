"""The node's one place for sync work done on the loop's behalf.

Reading SQLite or a file's header on the event loop stalls every connection the loop serves,
so a part that needs such a read hands it here: ``OffLoop(loop)(fn, done)`` runs ``fn`` in
the loop's default executor and calls ``done(result)`` back on the loop. The parts see only
that callable (``RuntimeEnv.off_loop``), so unit tests hand them one that runs ``fn`` inline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class OffLoop:
    """Runs sync work in the loop's default executor, the result handed back on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __call__(self, fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """``done(fn())`` on the loop, ``fn`` in a thread. ``fn`` must not raise (it turns its
        failures into a result ``done`` understands): an exception is a bug, logged, and
        ``done`` is not called."""
        self.loop.run_in_executor(None, fn).add_done_callback(lambda f: self._finish(f, done))

    @staticmethod
    def _finish(f: asyncio.Future, done: Callable[[Any], None]) -> None:
        if f.cancelled():  # the loop is closing: nothing waits any more
            return
        if (exc := f.exception()) is not None:
            log.error("sync work failed off the loop", exc_info=exc)
            return
        done(f.result())
