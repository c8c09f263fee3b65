"""One class model for REEF and PROTEAN on a real server (issue 12): a late real-time call
is served and counted ``missed``; a hard deadline still answers DEADLINE_MISSED and counts
``dropped``; under ``--class-order arrival`` an earlier best-effort call runs before a later
real-time one. The gate model holds the only instance so that every call waits."""

from __future__ import annotations

import re
import time

import httpx
import numpy as np
import pytest

from splitserve.client.fastpath import Client
from splitserve.client.http import HttpClient
from splitserve.errors import DeadlineMissed
from splitserve.models.gate import Gates
from tests.inproc import write_model


def key(k: int) -> np.ndarray:
    return np.array([[k]], np.int64)


def slo_counts(metrics: str, model: str) -> dict[str, float]:
    found = re.findall(rf'splitserve_slo_requests_total\{{class="rt",model="{model}",outcome="(\w+)"\}} (\S+)', metrics)
    return {outcome: float(n) for outcome, n in found}


def test_late_rt_is_served_and_missed_a_deadline_is_dropped_and_arrival_order_serves_be_first(
        server_factory, tmp_path):
    write_model(tmp_path / "repo", "gate", "gate", 'max_batch_size = 1\n[batching]\npolicy = "none"\n'
                                                   "[slo]\ntarget_ms = 60000.0")
    gates = Gates(tmp_path / "cache")
    s = server_factory("--repository", str(tmp_path / "repo"), "--load", "gate", "--preemption", "concurrent",
                       "--class-order", "arrival", http=True, cache_dir=tmp_path / "cache")
    try:
        with Client(s.tcp) as c, HttpClient(s.http) as h:
            gates.close(1)
            holder = c.submit("gate", key(1), cls="be")  # holds the only instance mid-run
            with httpx.Client(base_url=s.http, timeout=30) as web:
                give_up = time.monotonic() + 60
                while not gates.held(1):  # a file the worker writes once key 1 waits at its gate
                    assert time.monotonic() < give_up, "the gate never held key 1"
                    web.get("/v2/health/live")
                early_be = c.submit("gate", key(2), cls="be")
                late_rt = c.submit("gate", key(3), cls="rt", slo_ms=1)  # cannot be met: the instance is held
                with pytest.raises(DeadlineMissed):  # answered while the gate still holds key 1
                    c.infer_result("gate", key(4), cls="rt", deadline_ms=50)
                gates.open(1)
                assert int(holder.result().value()[0, 0]) == 1
                assert int(early_be.result().value()[0, 0]) == 2
                assert int(late_rt.result().value()[0, 0]) == 3  # late, and served all the same
                assert int(h.infer("gate", key(5), cls="rt")[0, 0]) == 5  # the model's SLO: 60 s, met
                starts = [e["cls"] for e in web.get("/v2/scheduler/events").json()["events"] if e["kind"] == "start"]
                metrics = web.get("/metrics").text
            (stats,) = h.stats("gate")["model_stats"]
    finally:
        gates.open_all()
    # the earlier best-effort call ran before the later real-time one (arrival order)
    assert starts == ["be", "be", "rt", "rt"]
    assert slo_counts(metrics, "gate") == {"met": 1.0, "missed": 1.0, "dropped": 1.0}
    assert stats["slo"] == {"met": 1, "missed": 1, "dropped": 1}
