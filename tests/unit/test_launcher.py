"""``stop_process``: the one way a child process is stopped (SIGTERM, a grace, SIGKILL, reaped)."""

from __future__ import annotations

import signal
import subprocess
import sys

from splitserve.launcher import stop_process

# A child that says it is ready once its SIGTERM handler is in place, then waits for stdin to close.
_CHILD = """
import signal, sys
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
sys.stdin.read()
"""


def _child(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _close(proc: subprocess.Popen) -> None:
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def test_a_child_that_obeys_sigterm_exits_with_it() -> None:
    proc = _child("obey")
    assert stop_process(proc, 30) == -signal.SIGTERM
    _close(proc)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    proc = _child("ignore")
    assert stop_process(proc, 0.1) == -signal.SIGKILL
    _close(proc)


def test_without_terminate_the_child_is_left_to_exit_on_its_own() -> None:
    proc = _child("ignore")
    assert proc.stdin is not None
    proc.stdin.close()  # its end of input: it exits by itself
    assert stop_process(proc, 30, terminate=False) == 0
    _close(proc)


def test_a_child_that_already_exited_is_only_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    assert stop_process(proc, 0) == 3
