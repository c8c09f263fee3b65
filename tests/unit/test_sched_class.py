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
