"""Polling before sleeping (splitserve/spin.py): the decider, the host's load, the worker poller's wait and the client's."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput
from splitserve.worker.poller import Poller
from splitserve.spin import (
    BACKOFF_MAX_NS,
    BACKOFF_NS,
    BUSY_HOLD_NS,
    BUSY_READS,
    BUSY_READS_AFTER_RUN,
    LOAD_PERIOD_NS,
    HostLoad,
    SpinPolicy,
    cpu_free,
)

US = 1000


def test_calls_that_come_close_are_polled_for():
    p = SpinPolicy(100 * US)
    assert p.window_ns() == 100 * US  # nothing seen yet: poll, and learn
    for _ in range(20):
        p.observe(30 * US)
    assert p.window_ns() == 100 * US


def test_a_few_long_gaps_stop_the_poll_and_the_first_close_call_brings_it_back():
    p = SpinPolicy(100 * US)
    p.observe(10 * 1_000_000_000)  # idle for 10 s: counted as 4 budgets, not 10 s
    assert p.gap_ns == pytest.approx(100 * US)
    p.observe(10 * 1_000_000_000)
    assert p.window_ns() == 0  # calls come seldom: sleep at once
    p.observe(30 * US)
    assert p.gap_ns > p.budget_ns  # the EWMA still remembers the idle stretch...
    assert p.window_ns() == 100 * US  # ...but a call that came close brings the poll back
    p.observe(150 * US)
    assert p.window_ns() == 0  # and one that did not stops it again


def test_calls_that_come_a_little_too_far_apart_are_not_polled_for():
    p = SpinPolicy(100 * US)
    for _ in range(20):
        p.observe(130 * US)
    assert p.window_ns() == 0


def test_never_when_off():
    off = SpinPolicy(0)
    off.observe(1)
    assert off.window_ns() == 0
    with pytest.raises(ValueError):
        SpinPolicy(-1)
    with pytest.raises(InvalidInput, match="direct_spin_us"):
        ServerConfig.from_env(direct_spin_us=-1)
    with pytest.raises(InvalidInput, match="front_end_spin_us"):
        ServerConfig.from_env(front_end_spin_us=-1)


def test_a_busy_host_makes_a_side_back_off_for_ever_longer_up_to_a_bound_and_a_poll_its_event_ends_resets_it():
    p = SpinPolicy(100 * US)
    assert p.window_ns() == 100 * US
    p.observe(20 * US, busy=True, now_ns=1000)  # a busy host ended that poll
    assert p.skipping(1000 + BACKOFF_NS - 1) and not p.skipping(1000 + BACKOFF_NS)
    t = 1000 + BACKOFF_NS
    assert p.window_ns() == 100 * US
    p.observe(20 * US, busy=True, now_ns=t)  # ended so again: twice as long
    assert p.skipping(t + 2 * BACKOFF_NS - 1) and not p.skipping(t + 2 * BACKOFF_NS)
    for _ in range(10):  # bounded
        t += p.backoff_ns
        assert p.window_ns() == 100 * US  # a back-off over: the next wait polls, and its first look decides
        p.observe(20 * US, busy=True, now_ns=t)
    assert p.backoff_ns == BACKOFF_MAX_NS and not p.skipping(t + BACKOFF_MAX_NS)
    t += BACKOFF_MAX_NS
    p.observe(20 * US, busy=False, now_ns=t)  # its event ended the poll: the back-off is over
    p.observe(20 * US, now_ns=t)  # a wait that did not poll says nothing of the host
    p.observe(20 * US, busy=True, now_ns=t)
    assert p.backoff_ns == BACKOFF_NS  # from the start again


def test_calls_that_come_seldom_are_not_polled_for_and_do_not_back_off():
    p = SpinPolicy(100 * US)
    for _ in range(4):
        p.observe(10 * 1_000_000_000)
    assert p.window_ns() == 0  # calls come seldom
    assert not p.skipping(0)


def test_a_cpu_is_free_while_the_runnable_tasks_are_at_most_the_cpus():
    assert cpu_free("0.50 0.40 0.30 2/345 999", cpus=2)  # the reader and one more: one each
    assert not cpu_free("3.10 2.00 1.00 3/345 999", cpus=2)  # one of three waits
    assert not cpu_free("garbage", cpus=2)


def test_host_load_reads_the_file_at_most_once_a_period_and_is_busy_after_reads_in_a_row_that_hold(tmp_path):
    f = tmp_path / "loadavg"
    f.write_text("0.1 0.1 0.1 1/100 5\n")
    load = HostLoad(str(f))
    load.cpus = 2
    assert load.cpu_free(0)
    f.write_text("9.0 9.0 9.0 9/100 5\n")
    assert load.cpu_free(LOAD_PERIOD_NS - 1)  # not read again yet
    assert BUSY_READS == 2
    assert load.cpu_free(LOAD_PERIOD_NS)  # one read that finds a task waiting may be a kernel thread's moment
    f.write_text("0.1 0.1 0.1 2/100 5\n")
    assert load.cpu_free(2 * LOAD_PERIOD_NS)  # it was: read again a period on
    f.write_text("9.0 9.0 9.0 9/100 5\n")
    assert load.cpu_free(3 * LOAD_PERIOD_NS)
    assert not load.cpu_free(4 * LOAD_PERIOD_NS)  # two in a row: busy (a poll ends), and the verdict holds
    f.write_text("0.1 0.1 0.1 2/100 5\n")
    # a host whose cores are taken is not read (and polled on) at every wait
    assert not load.cpu_free(4 * LOAD_PERIOD_NS + BUSY_HOLD_NS - 1)
    assert load.cpu_free(4 * LOAD_PERIOD_NS + BUSY_HOLD_NS)  # free again at the first read that finds none waiting
    load.close()
    assert not HostLoad(str(tmp_path / "missing")).cpu_free(0)


def test_a_host_load_that_needs_more_busy_reads_lets_a_moment_of_contention_pass_and_ends_at_a_lasting_one(tmp_path):
    """A worker's poll after a front-end batch (``BUSY_READS_AFTER_RUN``): the call's own client,
    front end and worker meet on two cores for a moment at each hand-over; another process that
    keeps a core ends the poll all the same, a few reads later."""
    f = tmp_path / "loadavg"
    load = HostLoad(str(f), busy_reads=BUSY_READS_AFTER_RUN)
    load.cpus = 2
    assert BUSY_READS < BUSY_READS_AFTER_RUN
    f.write_text("9.0 9.0 9.0 3/100 5\n")
    t = 0
    for _ in range(BUSY_READS_AFTER_RUN - 1):  # a hand-over's moment: more reads than BUSY_READS, fewer than these
        assert load.cpu_free(t)
        t += LOAD_PERIOD_NS
    f.write_text("0.1 0.1 0.1 2/100 5\n")
    assert load.cpu_free(t)  # the moment passed: the count starts again
    f.write_text("9.0 9.0 9.0 3/100 5\n")
    for _ in range(BUSY_READS_AFTER_RUN - 1):
        t += LOAD_PERIOD_NS
        assert load.cpu_free(t)
    t += LOAD_PERIOD_NS
    assert not load.cpu_free(t)  # it lasted: busy, and the verdict holds as with the default
    assert not load.cpu_free(t + BUSY_HOLD_NS - 1)
    assert load.poll_check() is not None and load.poll_check()[3] == BUSY_READS_AFTER_RUN
    load.close()
    with pytest.raises(ValueError):
        HostLoad(str(f), busy_reads=0)


def test_the_real_host_load_is_read_through_one_descriptor():
    load = HostLoad()
    load.cpu_free(0)
    fd = load._fd
    assert fd >= 0
    load.cpu_free(LOAD_PERIOD_NS)
    assert load._fd == fd  # read again, not reopened
    load.close()


def test_a_poll_stops_at_the_first_look_that_finds_a_task_waiting_for_a_cpu():
    a, b = socket.socketpair()
    poller = Poller()
    looks: list[int] = []
    busy = threading.Event()

    def cpu_free(_now_ns: int) -> bool:
        looks.append(_now_ns)
        if len(looks) < 3:
            return True
        busy.set()
        return False

    try:
        poller.register(a.fileno(), select.EPOLLIN, None)
        # the byte comes only once the host turned busy: a poll that went on would look again
        threading.Thread(target=lambda: busy.wait(10) and b.send(b"x"), daemon=True).start()
        assert poller.wait(None, spin_ns=60_000_000_000, cpu_free=cpu_free) == [(a.fileno(), select.EPOLLIN)]
        assert len(looks) == 3  # it slept in epoll_wait from the look that found the host busy
        assert poller.busy  # and says why its poll ended, for the policy to back off
    finally:
        poller.close()
        a.close()
        b.close()


def test_the_poller_returns_an_event_that_comes_while_it_polls_and_sleeps_after():
    a, b = socket.socketpair()
    poller = Poller()
    try:
        poller.register(a.fileno(), select.EPOLLIN, None)
        # nothing comes: the poll and then the sleep together last about the timeout
        t0 = time.monotonic()
        assert poller.wait(0.05, spin_ns=5_000_000) == []
        assert 0.045 <= time.monotonic() - t0 < 1.0
        # a byte while it polls
        threading.Timer(0.002, b.send, (b"x",)).start()
        assert poller.wait(1.0, spin_ns=500_000_000, cpu_free=lambda _now: True) == [(a.fileno(), select.EPOLLIN)]
        assert not poller.busy  # its event ended the poll
        a.recv(1)
        # a byte after the poll: the sleep takes it
        threading.Timer(0.05, b.send, (b"y",)).start()
        assert poller.wait(2.0, spin_ns=1_000_000) == [(a.fileno(), select.EPOLLIN)]
        a.recv(1)
        # a poll longer than the timeout is cut to it
        t0 = time.monotonic()
        assert poller.wait(0.01, spin_ns=2_000_000_000) == []
        assert time.monotonic() - t0 < 1.0
    finally:
        poller.close()
        a.close()
        b.close()
