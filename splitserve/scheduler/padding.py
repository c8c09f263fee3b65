"""Padding under preemption ``idle``: which best-effort (BE) work may run beside real-time (RT)
work, from measured interference. Pure.

Under ``idle`` the kernel takes a core from a BE thread the moment an RT thread wants it, so
BE work never delays RT work by holding a core. What the kernel cannot take back is what the
two share without a scheduler: memory bandwidth, caches, SMT siblings. PROTEAN measures that
as each model's FBR (``protean/slowdown.py``, fitted from co-location runs and stored as a
profile); Eq. 1 predicts every co-runner's slowdown as max{ΣFBR, 1}. REEF's dynamic padding,
in CPU terms: while RT work is about (running, or waiting for a batch), BE batches run beside
it only as long as Eq. 1 keeps each active RT model's predicted slowdown within ``limit``.
A BE batch that would break it is not started, and one already running is stopped at its
next segment boundary (``reef``'s mechanism, where segment preemption still wins), unless it
is expected to have ended by now (a stop would land when it ends anyway).

Only measured interference holds work back: a pair where either model has no fitted FBR
co-runs as the kernel's preemption alone would have it (not given: splitserve's choice; the
conservative reading, an unmeasured model needing the whole bandwidth, would turn ``idle``
into ``seq`` on every node without profiles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitserve.protean.slowdown import interference
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.priority import Decision, InstanceView

# The predicted RT slowdown padding allows: REEF's goal of RT latency within 5 % of running alone.
DEFAULT_LIMIT = 1.05


@dataclass(frozen=True)
class Padding:
    """One moment's padding: ``hold``, the BE instances that may not start a batch now;
    ``stop``, the running BE batches (model, instance, batch) to stop at a segment boundary;
    ``rt_slowdown``, each active RT model's predicted slowdown beside the BE work left running."""

    hold: frozenset[tuple[str, int]] = frozenset()
    stop: tuple[tuple[str, int, int], ...] = ()
    rt_slowdown: tuple[tuple[str, float], ...] = ()


def pad(node: list[InstanceView], fbr: Callable[[str], float | None], now: float,
        limit: float = DEFAULT_LIMIT) -> Padding:
    """Which BE work may run beside the node's active RT work at ``now``.

    ``fbr(model)`` is a model's fitted FBR (None: not measured). BE batches already running
    keep their place in the order they started; each idle BE instance whose model has BE
    work waiting, or which holds a preempted batch, is then admitted in the node's order
    while every active RT model's predicted slowdown stays within ``limit`` (one with none
    waiting starts nothing now: it takes none of the room, and the next pass, which its
    first BE arrival starts, decides for it).
    A model's BE batch on an instance that takes both classes is left to ``priority.decide``,
    which preempts it for the model's own RT work; one on an instance kept for BE work
    (``be_instances``) is padded like any other.
    """
    rt_models = {v.model for v in node if v.ready and (v.running_cls == RequestClass.RT or v.rt_waiting)}
    rt_fbr = {m: f for m in rt_models if (f := fbr(m)) is not None}
    if not rt_fbr:
        return Padding()
    be_load: list[float] = []  # FBRs of the BE batches admitted so far
    hold: set[tuple[str, int]] = set()
    stop: list[tuple[str, int, int]] = []

    def fits(model: str) -> bool:
        # slowdown against the RT model alone (whose own FBR may exceed 1 on a CPU, Eq. 1's floor)
        own = fbr(model)
        return own is None or all(interference([f, *be_load, own]) <= limit * interference([f])
                                  for f in rt_fbr.values())

    def padded(v: InstanceView) -> bool:  # a BE instance of an RT model pads beside it too
        return v.model not in rt_models or v.best_effort

    running = sorted((v for v in node if v.running_cls == RequestClass.BE and padded(v)),
                     key=lambda v: v.started if v.started is not None else now)
    for v in running:
        own = fbr(v.model)
        if fits(v.model):
            be_load.extend(() if own is None else (own,))
        elif v.expected_end is None or v.expected_end > now:
            stop.append((v.model, v.instance, v.running_batch))
        else:  # about to end: it still shares the bandwidth until it does
            be_load.append(own if own is not None else 0.0)
    for v in node:  # an idle instance with BE work to start or resume counts as if it starts a batch
        if v.ready and v.running_cls is None and (v.be_waiting or v.suspended) and padded(v):
            own = fbr(v.model)
            if fits(v.model):
                be_load.extend(() if own is None else (own,))
            else:
                hold.add((v.model, v.instance))
    slowdown = tuple((m, interference([f, *be_load]) / interference([f])) for m, f in sorted(rt_fbr.items()))
    return Padding(frozenset(hold), tuple(stop), slowdown)


def apply(d: Decision, p: Padding) -> Decision:
    """``d`` with ``p`` applied: held instances start no BE batch, and the batches to stop
    join ``d``'s preemptions (each once)."""
    for k in p.hold:
        d.may_start.get(k, set()).discard(RequestClass.BE)
    d.preempt.extend(b for b in p.stop if b not in d.preempt)
    return d
