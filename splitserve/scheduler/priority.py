"""Node-wide priority between real-time (RT) and best-effort (BE) work. Pure.

The node is seen as a list of ``InstanceView``: which CPUs an instance is pinned to and
what it runs. ``decide`` says, for one moment, which instances may start which class,
which BE batches to preempt, and how long padded BE work may keep running.

Modes (REEF §3.1 and the §7.1 baselines):
- ``reef``: RT work claims the CPUs of the instances it runs (or will run) on. BE batches
  on claimed CPUs are preempted at their next segment boundary and resumed later from
  their restore point; BE work on other CPUs goes on beside it (padding) only while each
  of its segments ends before the RT work is expected to finish (rule 1, adapted).
- ``idle``: REEF's preemption done by the kernel. Best-effort instances (models whose
  default class is ``be``) run on the same cores as real-time ones with every worker
  thread under ``SCHED_IDLE`` (``worker/sched_class.py``) and passive OpenMP pools, so a
  runnable real-time thread takes the core at once, mid-segment, and the best-effort
  thread resumes with its state intact. Nothing is flagged, padded or restored: the node
  lets everything start, as in ``concurrent``; a model with instances kept per class
  (``be_instances``) sends each class to its own, and a model that takes both classes on one
  instance has its BE batch preempted at a segment boundary for its own RT work, as in ``reef``.
- ``seq``: one batch at a time on the whole node, RT first, never interrupting (Clockwork);
  under ``ClassOrder.ARRIVAL`` the model whose oldest waiting request came first, whatever
  its class, takes the node (Molecule's time sharing).
- ``concurrent``: everything runs side by side, no priority (like several GPU streams).
- ``rt-only``: BE is refused at admission; RT runs as in ``concurrent``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import ClassOrder
from splitserve.types import Choice


class PriorityMode(Choice, what="preemption mode"):
    """How RT and BE work share the node (the modes above); ``ServerConfig.reef.preemption``."""

    REEF = "reef"
    IDLE = "idle"
    SEQ = "seq"
    CONCURRENT = "concurrent"
    RT_ONLY = "rt-only"


@dataclass(frozen=True)
class InstanceView:
    """One instance as the node sees it at a moment."""

    model: str
    instance: int
    cpus: frozenset[int]
    ready: bool
    running_cls: RequestClass | None = None  # class of the running batch, if any
    running_batch: int = 0
    preempt_raised: bool = False
    expected_end: float | None = None  # when the running batch should finish (profiled)
    suspended: bool = False  # holds a preempted BE batch
    rt_waiting: int = 0  # RT requests waiting for this instance's model
    oldest_waiting: float | None = None  # arrival of its model's oldest waiting request, any class
    partition: int = -1  # the node partition it sits on (-1: the node has none)
    running_count: int = 0  # samples in the running batch (its memory footprint, for PROTEAN's placement)
    started: float | None = None  # when the running batch started (PROTEAN's wait-for-free predicts its end)
    rt_due: float | None = None  # soft SLO due of the RT request heading its model's next batch (bounds a wait)
    best_effort: bool = False  # kept for BE batches (its model's be_instances): under idle, never an RT target
    be_waiting: int = 0  # BE requests waiting for this instance's model (in the node's queue)


@dataclass
class Decision:
    may_start: dict[tuple[str, int], set[RequestClass]] = field(default_factory=dict)
    preempt: list[tuple[str, int, int]] = field(default_factory=list)  # (model, instance, batch)
    padding_deadline: dict[tuple[str, int], float] = field(default_factory=dict)  # 0.0 = none
    rt_mode: bool = False


def _rt_targets(node: list[InstanceView]) -> list[InstanceView]:
    """For each model with RT waiting, the instance its RT work will take: its first idle
    ready instance, else the BE batch already being preempted, else its first BE batch."""
    by_model: dict[str, list[InstanceView]] = {}
    for v in node:
        if v.ready and not v.best_effort:
            by_model.setdefault(v.model, []).append(v)
    targets = []
    for views in by_model.values():
        if not views[0].rt_waiting:
            continue
        idle = [v for v in views if v.running_cls is None]
        be = [v for v in views if v.running_cls == RequestClass.BE]
        if idle:
            targets.append(idle[0])
        elif be:
            targets.append(next((v for v in be if v.preempt_raised), be[0]))
    return targets


def rt_claims(node: list[InstanceView]) -> frozenset[int]:
    """CPUs that RT work runs on now or is about to: instances running RT, plus for each
    model with RT waiting and no idle instance, the instance it will preempt."""
    claimed: set[int] = set()
    for v in node:
        if v.running_cls == RequestClass.RT:
            claimed |= v.cpus
    for v in _rt_targets(node):
        claimed |= v.cpus
    return frozenset(claimed)


def decide(mode: PriorityMode, node: list[InstanceView], order: ClassOrder = ClassOrder.PRIORITY) -> Decision:
    """What each instance may do now under ``mode`` (``order`` matters only to ``seq``)."""
    d = Decision()
    keys = [(v.model, v.instance) for v in node]
    if mode in (PriorityMode.CONCURRENT, PriorityMode.RT_ONLY):
        d.may_start = {k: {RequestClass.RT, RequestClass.BE} for k in keys}
        return d
    if mode is PriorityMode.IDLE:
        # The kernel puts RT first across instances (BE workers under SCHED_IDLE); only a
        # model taking both classes on one instance has its BE batch stopped at a segment
        # boundary for its own RT work: no scheduler can take a worker from itself.
        split = {v.model for v in node if v.best_effort}  # models with instances kept per class
        d.may_start = {(v.model, v.instance): {RequestClass.BE} if v.best_effort else
                       {RequestClass.RT} if v.model in split else {RequestClass.RT, RequestClass.BE} for v in node}
        d.preempt = [(v.model, v.instance, v.running_batch) for v in _rt_targets(node)
                     if v.running_cls == RequestClass.BE and not v.preempt_raised]
        return d
    if mode is PriorityMode.SEQ and order is ClassOrder.ARRIVAL:
        waiting = [v for v in node if v.ready and v.oldest_waiting is not None]
        busy = any(v.running_cls is not None for v in node)
        first = None if busy or not waiting else min(waiting, key=lambda v: v.oldest_waiting or 0.0).model
        d.may_start = {k: ({RequestClass.RT, RequestClass.BE} if k[0] == first else set()) for k in keys}
        return d
    if mode is PriorityMode.SEQ:
        busy = any(v.running_cls is not None for v in node)
        rt_waiting = any(v.rt_waiting for v in node)
        allowed = set() if busy else ({RequestClass.RT} if rt_waiting else {RequestClass.RT, RequestClass.BE})
        d.may_start = {k: set(allowed) for k in keys}
        return d
    claimed = rt_claims(node)
    d.rt_mode = bool(claimed)
    rt_running = any(v.running_cls == RequestClass.RT for v in node)
    rt_end = min((v.expected_end for v in node if v.running_cls == RequestClass.RT and v.expected_end), default=0.0)
    for v in node:
        k = (v.model, v.instance)
        overlaps = bool(v.cpus & claimed)
        # A BE batch stopped for RT work (preempted, or out of padding time) waits until the
        # RT work is done: resuming it at once would only run into the same limit again.
        held = v.suspended and rt_running
        d.may_start[k] = {RequestClass.RT} if overlaps or held else {RequestClass.RT, RequestClass.BE}
        if v.running_cls == RequestClass.BE:
            if overlaps:
                if not v.preempt_raised:
                    d.preempt.append((v.model, v.instance, v.running_batch))
            else:
                d.padding_deadline[k] = rt_end if d.rt_mode else 0.0
    return d
