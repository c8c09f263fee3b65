"""When the node next looks at its workers' pages.

A worker counts its direct calls in a shared page (``worker/counters.py``); the node reads the
pages (``Coordinator.watch_direct``) to give the memory manager's LRU and Packrat's estimator
the direct use, to hear that direct calls no longer hold a model a load waits on, and under
REEF to ring the workers' bells and see direct real-time batches. It reads them every
``direct_poll_s`` (5 ms) while a read finds something to follow: direct calls arriving or
held, or under REEF any work of either class. Each read that finds nothing doubles the wait
before the next, up to ``direct_idle_poll_s``. On the 2-core VM an idle node with lenet
loaded woke 191 times a second on the fixed period and 21 times backed off
(``benchmarks/idle_node.py``); its CPU did not move (33 ms a second either way): a read
after 50 ms asleep runs cold and costs what the ten warm ones it replaces did. While direct
calls come, every read finds them and the period is ``direct_poll_s`` as before.

What a read that comes later costs: the first direct calls after an idle stretch reach the LRU
and Packrat's estimator up to ``direct_idle_poll_s`` late, and under REEF a direct real-time
batch that starts beside direct best-effort work on an idle node is seen that late. Front-end
work under REEF (``hurry``) brings the next read within ``direct_poll_s`` at once, so a
front-end best-effort batch beside direct real-time work is preempted as promptly as before.
"""

from __future__ import annotations


class LookPeriod:
    """The wait before the node's next read of its workers' pages (a pure decider):
    ``base_s`` after a read that found something to follow, else twice the last wait, up to
    ``idle_s``."""

    def __init__(self, base_s: float, idle_s: float) -> None:
        if not 0 < base_s <= idle_s:
            raise ValueError("need 0 < base_s <= idle_s")
        self.base_s = base_s
        self.idle_s = idle_s
        self.wait_s = base_s

    def next(self, found: bool) -> float:
        """The wait after a read that ``found`` something to follow (or nothing)."""
        self.wait_s = self.base_s if found else min(self.idle_s, 2 * self.wait_s)
        return self.wait_s

    @property
    def backed_off(self) -> bool:
        """The next read comes later than ``base_s`` after the last."""
        return self.wait_s > self.base_s

    def hurry(self) -> None:
        """Something to follow began: the waits are ``base_s`` again."""
        self.wait_s = self.base_s
