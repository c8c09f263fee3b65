"""The OS scheduling class of a worker's threads: REEF's preemption at the kernel's speed.

Under preemption ``idle`` a best-effort instance's worker runs every thread under
``SCHED_IDLE``: the kernel gives its core to any runnable normal thread at once and lets
it resume later with its state intact, so a real-time batch on the same cores never waits
for a best-effort segment. ``SCHED_IDLE`` is the strongest demotion an unprivileged
process may take; where it is refused (a seccomp filter, a container without the
syscall) the threads fall back to nice 19, which still yields but far less sharply.

The class is set on every thread, not only the calling one: Linux keeps it per thread,
and a reused process may already hold the pool threads of a model it served before.
Threads started afterwards (torch's pools grow on the first parallel op) inherit it from
the thread that starts them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

IDLE_NICE = 19  # the fallback where SCHED_IDLE is refused


def _tids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def set_idle(idle: bool) -> str:
    """Put every thread of this process under ``SCHED_IDLE`` (``idle``) or back under
    ``SCHED_OTHER`` at nice 0; returns what it applied: ``"idle"``, ``"nice"`` (the
    fallback) or ``"normal"``."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    applied = "idle" if idle else "normal"
    for tid in _tids():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 0)  # undo a fallback's nice from an earlier binding
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except PermissionError:
            if not idle:
                log.warning("thread %d could not leave its demotion: a normal model now runs at a lower "
                            "priority in this worker", tid)
                continue
            log.warning("SCHED_IDLE refused for thread %d: nice %d instead", tid, IDLE_NICE)
            os.setpriority(os.PRIO_PROCESS, tid, IDLE_NICE)
            applied = "nice"
    return applied
