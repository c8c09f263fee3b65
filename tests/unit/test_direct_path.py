"""The direct path's pure parts: the request checks the front end and the workers share,
a direct call's way into (and aside from) the batch rows, and the counters page."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from splitserve.errors import BadSegment, BadSize, InvalidInput, Refused
from splitserve.modelconfig import ModelConfig
from splitserve.protocol.header import Header, Kind, RequestClass
from splitserve.protocol.requests import call_class, stream_samples
from splitserve.worker.counters import DirectCounts, WorkerCounters, Word, add_sizes
from splitserve.worker.direct_conn import _Call
from splitserve.worker.preempt_flag import PreemptFlag

VECADD = ModelConfig.from_dict({"name": "vecadd1k", "artifact": {"kind": "zoo", "arch": "vecadd1k"}})


def req(payload_len: int, **kw: int) -> Header:
    return Header(Kind.REQUEST, req_id=1, func_id=1, payload_len=payload_len, **kw)


def test_stream_samples_counts_whole_samples_and_names_what_is_wrong():
    per = VECADD.request_bytes  # two FP32[1024]
    assert stream_samples(req(3 * per), VECADD) == 3
    with pytest.raises(BadSize, match=f"multiple of {per} B"):
        stream_samples(req(per + 4), VECADD)
    with pytest.raises(BadSize, match="multiple"):
        stream_samples(req(0), VECADD)
    with pytest.raises(BadSegment, match="seg_count"):
        stream_samples(req(per, seg_count=2), VECADD)
    with pytest.raises(BadSize, match="exceed max_batch_size 2"):
        stream_samples(req(3 * per), VECADD, max_batch=2)


def test_call_class_takes_the_models_default_and_refuses_be_in_rt_only():
    assert call_class(RequestClass.DEFAULT, RequestClass.BE, rt_only=False) is RequestClass.BE
    assert call_class(RequestClass.RT, RequestClass.BE, rt_only=True) is RequestClass.RT
    with pytest.raises(Refused, match="rt-only"):
        call_class(RequestClass.BE, RequestClass.RT, rt_only=True)
    with pytest.raises(InvalidInput, match="request class"):
        call_class(7, RequestClass.RT, rt_only=False)


def _buffers(rows: int) -> tuple[list[np.ndarray], list[memoryview], list[int]]:
    arrays = [np.zeros((rows, 1024), np.float32) for _ in range(2)]
    return arrays, [memoryview(a).cast("B") for a in arrays], [4096, 4096]


def _feed(call: _Call, data: bytes, chunk: int) -> bool:
    """Take ``data`` into the call at most ``chunk`` bytes at a time, as reads from the
    staging buffer would; True once complete."""
    done, mv = False, memoryview(data)
    for off in range(0, len(data), chunk):
        done = call.fill(mv[off : off + chunk])
    return done


def test_a_call_lands_in_consecutive_rows_of_every_input():
    arrays, flat, sizes = _buffers(4)
    a, b = np.arange(2048, dtype=np.float32).reshape(2, 1024), -np.arange(2048, dtype=np.float32).reshape(2, 1024)
    call = _Call(None, 1, RequestClass.RT, 2, 4 * 4096, 0, 0)  # type: ignore[arg-type]
    call.place(1, flat, sizes)
    assert _feed(call, a.tobytes() + b.tobytes(), 4096)
    np.testing.assert_array_equal(arrays[0][1:3], a)
    np.testing.assert_array_equal(arrays[1][1:3], b)
    assert not arrays[0][0].any() and not arrays[0][3].any()  # other rows untouched


def test_a_payload_that_comes_whole_is_copied_into_its_rows_and_one_in_pieces_lands_alike():
    arrays, flat, sizes = _buffers(4)
    payload = np.random.default_rng(1).standard_normal(4096).astype(np.float32).tobytes()  # two samples
    whole = _Call(None, 1, RequestClass.RT, 2, len(payload), 0, 0)  # type: ignore[arg-type]
    whole.place(0, flat, sizes)
    assert whole.fill(memoryview(payload)) and whole.views is None  # one copy per input, no views made
    pieces = _Call(None, 1, RequestClass.RT, 2, len(payload), 0, 0)  # type: ignore[arg-type]
    pieces.place(2, flat, sizes)
    assert not _feed(pieces, payload[:5000], 3000)  # across the first input's end
    assert [len(t) for t in pieces.targets()] == [2 * 4096 - 5000, 2 * 4096]  # what a scatter read fills
    assert _feed(pieces, payload[5000:], 3000)
    np.testing.assert_array_equal(arrays[0][0:2], arrays[0][2:4])
    np.testing.assert_array_equal(arrays[1][0:2], arrays[1][2:4])
    assert arrays[0][0:2].tobytes() + arrays[1][0:2].tobytes() == payload


def test_a_call_moved_aside_mid_payload_keeps_its_bytes_and_takes_new_rows_whole():
    arrays, flat, sizes = _buffers(4)
    payload = np.random.default_rng(0).standard_normal(2048).astype(np.float32).tobytes()
    call = _Call(None, 1, RequestClass.BE, 1, len(payload), 0, 0)  # type: ignore[arg-type]
    call.place(0, flat, sizes)
    assert not _feed(call, payload[:5000], 1000)  # past the first input, into the second
    call.move_aside()
    assert call.row == -1
    arrays[0][:] = 7.0  # the batch that ran reuses the rows
    arrays[1][:] = 7.0
    assert _feed(call, payload[5000:], 1000)
    call.place_from_aside(3, flat, sizes)
    assert call.row == 3 and call.aside is None
    np.testing.assert_array_equal(arrays[0][3].tobytes() + arrays[1][3].tobytes(), payload)
    assert (arrays[0][:3] == 7.0).all()


def test_counters_count_per_binding_and_keep_the_front_ends_admission_limit():
    flag = PreemptFlag()
    try:
        front, worker = WorkerCounters(flag.page), WorkerCounters(flag.page)  # two views of one page
        front.set_admit(64)
        worker.add(Word.RECEIVED, 3)
        worker.add(Word.IN_FLIGHT_BE, 2)
        worker.sub(Word.IN_FLIGHT_BE)
        worker.add(Word.ANSWERED)
        assert front.snapshot() == DirectCounts()  # counted, not yet written
        worker.flush()
        snap = front.snapshot()
        assert (snap.received, snap.answered, snap.in_flight_be) == (3, 1, 1) and worker.admit() == 64
        assert snap.finished() == DirectCounts(received=3, answered=1)
        assert (snap + snap).received == 6
        worker.answered(Word.IN_FLIGHT_BE, 1, 4096, 7)  # the largest batch a model may run
        worker.answered(Word.IN_FLIGHT_BE, 0, 1, 5)
        worker.answered(Word.IN_FLIGHT_BE, 0, 1, 6)
        assert front.batch_sizes() == {1: (2, 11), 4096: (1, 7)}
        assert add_sizes(front.batch_sizes(), {1: (1, 1), 3: (1, 2)}) == {1: (3, 12), 3: (1, 2), 4096: (1, 7)}
        worker.reset()  # a new binding
        assert front.snapshot() == DirectCounts() and worker.admit() == 64 and front.batch_sizes() == {}
        flag.raise_for(5)  # the flag's own words are not the counters'
        assert front.snapshot() == DirectCounts() and flag.target() == 5
    finally:
        flag.close()


def test_direct_slo_outcomes_join_the_slo_metric_and_tally_once_each():
    """The workers' pages hold running totals, read at every scrape and statistics call:
    each outcome is added once, and totals that start over (a new runtime) count afresh."""
    from splitserve.server.metrics import Metrics
    from splitserve.slo import SloOutcome

    m = Metrics()
    m.count_slo("m", RequestClass.RT, SloOutcome.MET)  # one through the front end
    m.count_direct_slo("m", DirectCounts(slo_met=2, slo_missed=1).slo())
    m.count_direct_slo("m", DirectCounts(slo_met=2, slo_missed=1).slo())  # read again: nothing new
    m.count_direct_slo("m", DirectCounts(slo_met=3, slo_missed=1, slo_dropped=1).slo())
    assert m.slo_tally("m") == {"met": 4, "missed": 1, "dropped": 1}
    m.count_direct_slo("m", DirectCounts(slo_missed=2).slo())  # counting afresh
    assert m.slo_tally("m") == {"met": 4, "missed": 3, "dropped": 1}
    text = m.render().decode()
    assert 'splitserve_slo_requests_total{class="rt",model="m",outcome="missed"} 3.0' in text
    assert 'splitserve_slo_requests_total{class="rt",model="m",outcome="met"} 4.0' in text


def test_direct_calls_join_the_per_model_counters_under_path_direct_once_each():
    """A scrape adds what the workers' pages counted since the last one to the counters a
    user sums per model, labelled ``path="direct"``; the front end's stay ``path="front"``."""
    from prometheus_client.parser import text_string_to_metric_families

    from splitserve.errors import Status, WorkerFailed
    from splitserve.server.metrics import Metrics, ModelGauges
    from splitserve.worker.counters import FAIL_STATUSES, DirectCalls, DirectTally

    def tally(ok: int, samples: int, failed: int, batches: int) -> DirectTally:
        fails = tuple(failed if s is Status.WORKER_FAILED else 0 for s in FAIL_STATUSES)
        return DirectTally(DirectCounts(batches=batches), {},
                           (DirectCalls(), DirectCalls(ok=ok, samples=samples, failures=fails)))

    def scrape(t: DirectTally) -> dict:
        m.refresh([ModelGauges("m", {}, 1, False, t)])
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}

    class _Call:  # what a front-end call's metrics read (``server.monitor.Call``)
        cls, count, t_ready, t_rx, t_dispatch, t_work, compute_ns = RequestClass.BE, 2, 0.0, 0.0, 0.0, 0.001, 1000

    m = Metrics()
    m.observe_call("m", _Call(), None)
    m.observe_call("m", _Call(), WorkerFailed("x"))
    scrape(tally(3, 5, 1, 2))
    got = scrape(tally(3, 5, 1, 2))  # read again: nothing new
    be = (("class", "be"), ("model", "m"))
    assert got[("splitserve_requests_total", (*be, ("path", "direct")))] == 3
    assert got[("splitserve_requests_total", (*be, ("path", "front")))] == 1
    assert got[("splitserve_inference_count_total", (*be, ("path", "direct")))] == 5
    assert got[("splitserve_inference_count_total", (*be, ("path", "front")))] == 2
    fail = (*be, ("path", "direct"), ("status", "WORKER_FAILED"))
    assert got[("splitserve_request_failures_total", fail)] == 1
    assert got[("splitserve_execution_count_total", (("model", "m"), ("path", "direct")))] == 2
    got = scrape(tally(1, 1, 0, 1))  # a new runtime's pages: counted afresh
    assert got[("splitserve_requests_total", (*be, ("path", "direct")))] == 4
    assert got[("splitserve_execution_count_total", (("model", "m"), ("path", "direct")))] == 3


def test_each_call_goes_to_a_worker_of_its_class_and_any_worker_serves_a_class_none_is_kept_for():
    """Under preemption idle a model's instance kept for best-effort work runs under SCHED_IDLE:
    a real-time call sent there waits behind its best-effort batch at the kernel's lowest rank."""
    from splitserve.client.common import Endpoint, ModelInfo
    from splitserve.client.route import _direct_targets, _Route

    info = ModelInfo("split", 1, (), (), 1, {"direct": ["unix:///d/1-0.sock", "unix:///d/1-1.sock"],
                                             "direct_classes": ["rt", "be"], "default_class": "be"})
    targets = _direct_targets(Endpoint.parse("unix:///d/fast.sock"), info)
    assert targets == [("unix:///d/1-0.sock", 1, False), ("unix:///d/1-1.sock", 1, True)]
    rt, be = (SimpleNamespace(best_effort=b) for _, _, b in targets)
    route = _Route(info, [rt, be], 0.0)
    assert {id(route.pick(int(RequestClass.RT))) for _ in range(4)} == {id(rt)}
    assert {id(route.pick(int(RequestClass.BE))) for _ in range(4)} == {id(be)}
    assert route.pick(int(RequestClass.DEFAULT)) is be  # the model's default class: best-effort
    route.set_streams([rt])  # its best-effort worker's connection closed: the other takes both classes
    assert route.pick(int(RequestClass.BE)) is rt
    route.set_streams([])
    assert route.pick(int(RequestClass.RT)) is None  # none: the front end's
    # a server that names no classes: every worker takes any call, in turn
    plain = ModelInfo("m", 1, (), (), 1, {"direct": ["unix:///d/1-0.sock", "unix:///d/1-1.sock"]})
    assert [b for _, _, b in _direct_targets(Endpoint.parse("unix:///d/fast.sock"), plain)] == [False, False]


def test_a_direct_client_looks_again_while_it_holds_fewer_connections_than_instances():
    """Under load a reloaded model's second instance may serve after the client's lookup: a route
    holding one of two instances' connections must be looked up again (it stayed at one forever)."""
    from splitserve.client.common import ModelInfo
    from splitserve.client.route import _lookup_interval, _Route

    info = ModelInfo("twin", 1, (), (), 1, {"instances": 2, "direct": ["a", "b"]})

    def due(held: int, age_s: float, stale: bool = False) -> bool:  # looked up at 100 s holding ``held``
        route = _Route(info, [SimpleNamespace(best_effort=False)] * held, 100.0 + _lookup_interval(held, info, 1.0))
        route.stale = stale
        return route.lookup_due(100.0 + age_s)

    assert due(1, 1.5)  # one of two, past the retry interval
    assert not due(1, 0.5)  # not before it
    assert not due(2, 5.0)  # all held
    assert due(2, 10.5)  # then now and then, for instances added since
    assert due(2, 0.0, stale=True)  # a connection closed


def test_a_direct_client_follows_the_endpoints_of_its_front_ends_kind_at_the_host_it_reached():
    """A unix:// client takes LOOKUP's ``direct`` (Unix sockets), a tcp:// one its
    ``direct_tcp`` ports at the host it reached the front end at: the workers bind the
    front end's address, which may be a wildcard or have another name from the client's
    side. From a server that names no TCP endpoints (direct_tcp off) a TCP client gets the
    Unix ones, which it only names in a HANDOFF (``handed_over_only``), never connects to:
    they may name another server's sockets on the client's own machine."""
    from splitserve.client.common import Endpoint, ModelInfo
    from splitserve.client.route import _direct_urls, handed_over_only

    both = ModelInfo("m", 1, (), (), 1, {"direct": ["unix:///d/1-0.sock"],
                                          "direct_tcp": ["tcp://0.0.0.0:41000", "tcp://[::]:41001"]})
    assert _direct_urls(Endpoint.parse("unix:///d/fast.sock"), both) == (["unix:///d/1-0.sock"], "direct_classes")
    assert _direct_urls(Endpoint.parse("tcp://node7.example:8100"), both) == (
        ["tcp://node7.example:41000", "tcp://node7.example:41001"], "direct_tcp_classes")
    assert _direct_urls(Endpoint.parse("tcp://[fe80::1]:8100"), both)[0] == ["tcp://[fe80::1]:41000",
                                                                             "tcp://[fe80::1]:41001"]
    unix_only = ModelInfo("m", 1, (), (), 1, {"direct": ["unix:///d/1-0.sock"], "direct_tcp": []})
    tcp = Endpoint.parse("tcp://127.0.0.1:8100")
    assert _direct_urls(tcp, unix_only) == (["unix:///d/1-0.sock"], "direct_classes")
    assert handed_over_only(tcp, "unix:///d/1-0.sock")
    assert not handed_over_only(tcp, "tcp://127.0.0.1:41000")
    assert not handed_over_only(Endpoint.parse("unix:///d/fast.sock"), "unix:///d/1-0.sock")


def test_the_tcp_endpoint_is_only_where_the_fast_path_listens_on_tcp_and_its_port_reaches_the_front_end():
    """Workers listen on TCP only with the direct path on, a TCP fast path and direct_tcp,
    at the fast path's own host; the port their OS picked comes back in LOADED."""
    from splitserve.config import ServerConfig
    from splitserve.server.management import exposure_warning
    from splitserve.worker.messages import LoadedMsg

    assert ServerConfig.of(fast_direct=True, host="10.1.2.3").direct_tcp_host == "10.1.2.3"
    assert ServerConfig.of(fast_direct=False).direct_tcp_host is None
    assert ServerConfig.of(fast_direct=True, fast_port=None).direct_tcp_host is None
    assert ServerConfig.of(fast_direct=True, direct_tcp=False).direct_tcp_host is None
    assert "direct endpoints on TCP" in exposure_warning(ServerConfig.of(host="0.0.0.0", fast_direct=True))
    assert "direct endpoints" not in exposure_warning(ServerConfig.of(host="0.0.0.0", fast_direct=False))
    msg = LoadedMsg(3, "m", 10, 20, 1, "cpu", None, 41000)
    assert LoadedMsg.unpack(msg.pack()) == msg
