"""``worker/sched_class.py`` in a process of its own: every thread demoted, threads started
later inherit the class, and a reused worker goes back to normal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import os, threading
from splitserve.worker.sched_class import set_idle

def policies():
    return {os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}

stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()  # a pool thread from before the LOAD
print(set_idle(True), sorted(policies()))
late = threading.Thread(target=lambda: print("late", os.sched_getscheduler(0))); late.start(); late.join()
print(set_idle(False), sorted(policies()), os.getpriority(os.PRIO_PROCESS, 0))
stop.set(); early.join()
"""


def test_every_thread_is_demoted_later_threads_inherit_and_a_rebinding_restores_normal():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True,
                         timeout=60).stdout.split("\n")
    assert out[0] == f"idle [{os.SCHED_IDLE}]"
    assert out[1] == f"late {os.SCHED_IDLE}"
    assert out[2] == f"normal [{os.SCHED_OTHER}] 0"


REFUSED = r"""
import errno, os, threading
from splitserve.worker import sched_class

real = os.sched_setscheduler
def refuse_idle(tid, policy, param):  # what a seccomp filter or a container's profile does
    if policy == os.SCHED_IDLE:
        raise PermissionError(errno.EPERM, "Operation not permitted")
    return real(tid, policy, param)
os.sched_setscheduler = refuse_idle

def state():
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    return sorted({os.sched_getscheduler(t) for t in tids}), sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids})

stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
print(sched_class.set_idle(True), *state())
late = threading.Thread(target=lambda: print("late", os.getpriority(os.PRIO_PROCESS, 0))); late.start(); late.join()
print(sched_class.set_idle(False), *state())
stop.set(); early.join()
"""


def test_where_sched_idle_is_refused_every_thread_falls_back_to_nice_19_and_a_rebinding_restores_it():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", REFUSED], capture_output=True, text=True, env=env, check=True,
                         timeout=60)
    out = run.stdout.split("\n")
    assert out[0] == f"nice [{os.SCHED_OTHER}] [19]"  # every thread, the pool's from before too
    assert out[1] == "late 19"  # a thread started afterwards inherits the nice
    # back to nice 0 needs the privilege to raise a priority (root here, as in CI)
    assert out[2] == f"normal [{os.SCHED_OTHER}] [0]"
    assert "SCHED_IDLE refused" in run.stderr  # the operator is told the demotion is the weaker one
