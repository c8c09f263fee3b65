"""REEF-style preemption with real worker processes, checked on the recorded event order."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from splitserve.modelconfig import ModelConfig
from splitserve.models.gate import Gates
from splitserve.models.zoo import build_zoo_model
from splitserve.protocol.header import RequestClass
from splitserve.worker.messages import Msg, RunMsg
from tests.inproc import inproc_worker, quiet_config, write_model
from tests.inproc import run_server as run_inproc


def test_preempted_at_every_segment_and_resumed_equals_an_uninterrupted_run(tmp_path):
    cfg = ModelConfig.from_dict({"name": "resnet152", "artifact": {"kind": "zoo", "arch": "resnet152"}})
    with inproc_worker(cfg, tmp_path, threads=torch.get_num_threads()) as (w, flag, ins, outs):
        x = np.random.default_rng(0).standard_normal((3, *cfg.inputs[0].shape)).astype(np.float32)
        start = ins[0].nslots - 1  # the batch wraps the ring too
        ins[0].array(start, 3, np.float32, cfg.inputs[0].shape)[:] = x
        with torch.inference_mode():
            (want,) = build_zoo_model("resnet152")(torch.from_numpy(x))
        segs = w.model.num_segments
        stops = []
        flag.raise_for(7)  # stop batch 7 at every boundary
        msg = RunMsg(int(RequestClass.BE), 7, start, 3, 0)
        while True:
            done = w.run(msg)
            if done.kind == Msg.DONE:
                break
            restore = done.first_segment + done.segments_run
            stops.append(restore)
            msg = RunMsg(int(RequestClass.BE), 7, start, 3, restore)
        assert stops == list(range(1, segs))  # preempted at every possible boundary
        got = outs[0].array(start, 3, np.float32, cfg.outputs[0].shape)
        assert np.array_equal(got, want.numpy())  # bit-identical: segments are idempotent


def run_server(tmp_path, mode, scenario):
    """resnet152 on CPU 0 and vgg19 on CPU 0 too: their work shares the CPU."""
    repo = tmp_path / f"repo-{mode}"
    for name in ("resnet152", "vgg19"):
        write_model(repo, name, name, "cpus = [0]\nshare_cpus = true")
    cfg = quiet_config(tmp_path / mode, repository=repo, load=("resnet152", "vgg19"), preemption=mode)
    return run_inproc(cfg, scenario)


def image(model, n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 3, 64, 64)).astype(np.float32)


BE_KEY, RT_KEY = 8001, 8002


def run_gated(tmp_path, mode, scenario, rt_cpus=(0,)):
    """Gate models: ``gate_be`` on CPU 0, ``gate_rt`` on ``rt_cpus`` (the same CPU unless told
    otherwise); ``scenario(server, gates)``. A gate holds a batch mid-run until the test opens
    it, so what runs while what is forced, not timed."""
    repo = tmp_path / f"repo-{mode}"
    for name, cpus in (("gate_be", (0,)), ("gate_rt", rt_cpus)):
        write_model(repo, name, "gate", f"cpus = {list(cpus)}\nshare_cpus = true")
    cfg = quiet_config(tmp_path / mode, repository=repo, cache_dir=tmp_path / "cache", load=("gate_be", "gate_rt"),
                       preemption=mode)
    gates = Gates(tmp_path / "cache")
    try:
        return run_inproc(cfg, lambda server: scenario(server, gates))
    finally:
        gates.open_all()


async def until(what, done):
    deadline = asyncio.get_running_loop().time() + 60
    while not done():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.002)


def wait_until(what, done):
    """``until`` for a test's own thread: polls ``done`` for up to 60 s, then fails naming ``what``."""
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def be_then_rt(rt_model, release_be, release_rt=None):
    """A best-effort batch on ``gate_be``, held at its gate (so provably mid-run) when a
    real-time request for ``rt_model`` arrives. The BE batch is let go once
    ``release_be(server)``; with ``release_rt``, the RT request is held at its gate until
    ``release_rt(server)``."""

    async def scenario(server, gates):
        gates.close(BE_KEY)
        if release_rt is not None:
            gates.close(RT_KEY)
        be = asyncio.ensure_future(server.infer("gate_be", [np.array([[BE_KEY]], np.int64)], cls="be"))
        await until("the best-effort batch at its gate", lambda: gates.held(BE_KEY))
        rt = asyncio.ensure_future(server.infer(rt_model, [np.array([[RT_KEY]], np.int64)], cls="rt"))
        await until("the moment to let the best-effort batch go", lambda: release_be(server))
        gates.open(BE_KEY)
        if release_rt is not None:
            await until("the moment to let the real-time request go", lambda: release_rt(server))
            gates.open(RT_KEY)
        rt_out, be_out = await rt, await be
        return list(server.coordinator.events), be_out, rt_out

    return scenario


def kinds(events, cls=None):
    return [(e.kind, e.cls) for e in events if cls is None or e.cls == cls]


def seen(kind, cls):
    return lambda server: (kind, cls) in kinds(server.coordinator.events)


@pytest.mark.parametrize("mode", ["reef", "idle"])  # idle: no scheduler can take a worker from itself
def test_reef_rt_preempts_be_of_the_same_model_and_be_resumes_correctly(tmp_path, mode):
    events, be_out, rt_out = run_gated(tmp_path, mode, be_then_rt("gate_be", seen("preempt", "be")))
    seq = kinds(events)
    assert seq == [("start", "be"), ("preempt", "be"), ("preempted", "be"), ("start", "rt"), ("done", "rt"),
                   ("resume", "be"), ("done", "be")], seq
    preempted = next(e for e in events if e.kind == "preempted")
    resumed = next(e for e in events if e.kind == "resume")
    assert preempted.segment == resumed.segment == 1  # the gate's boundary: after its holding segment
    assert be_out.outputs[0].ravel().tolist() == [BE_KEY]  # resumed at segment 1, its own answer
    assert rt_out.outputs[0].ravel().tolist() == [RT_KEY]


def test_reef_a_preempted_segmented_batch_resumes_from_its_restore_point_with_the_right_numbers(tmp_path):
    """The server-level check of restore: a real segmented model's best-effort batch (8
    images through resnet152, far longer than a segment) is stopped by a real-time call sent
    as soon as the batch starts, resumes where it stopped, and answers what an uninterrupted
    run gives; so does the real-time call."""

    async def scenario(server):
        be = asyncio.ensure_future(server.infer("resnet152", [image("resnet152", 8)], cls="be"))
        await until("the best-effort batch starts", lambda: ("start", "be") in kinds(server.coordinator.events))
        rt = await server.infer("resnet152", [image("resnet152", 1, seed=1)], cls="rt")
        be_out = await be  # the log once both are answered: the resume follows the real-time answer
        return list(server.coordinator.events), be_out, rt

    events, be_out, rt_out = run_server(tmp_path, "reef", scenario)
    preempted = [e for e in events if e.kind == "preempted" and e.cls == "be"]
    resumed = [e for e in events if e.kind == "resume" and e.cls == "be"]
    assert preempted and [e.segment for e in resumed] == [e.segment for e in preempted], kinds(events)
    assert all(0 < e.segment < 16 for e in preempted)  # stopped between segments, not before or after
    with torch.inference_mode():
        model = build_zoo_model("resnet152")
        (want_be,) = model(torch.from_numpy(image("resnet152", 8)))
        (want_rt,) = model(torch.from_numpy(image("resnet152", 1, seed=1)))
    np.testing.assert_allclose(be_out.outputs[0], want_be.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rt_out.outputs[0], want_rt.numpy(), rtol=1e-4, atol=1e-5)


def test_reef_rt_of_another_model_starts_at_once_and_be_on_its_cpus_stops_at_a_boundary(tmp_path):
    rt_running = seen("start", "rt")
    events, be_out, rt_out = run_gated(tmp_path, "reef", be_then_rt(
        "gate_rt", lambda s: rt_running(s) and seen("preempt", "be")(s), release_rt=seen("preempted", "be")))
    seq = kinds(events)
    # the RT request starts before the BE batch has even stopped: it does not wait for it
    assert seq.index(("start", "rt")) < seq.index(("preempted", "be"))
    assert seq[-2:] == [("resume", "be"), ("done", "be")]
    assert be_out.outputs[0].ravel().tolist() == [BE_KEY] and rt_out.outputs[0].ravel().tolist() == [RT_KEY]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="padding needs a CPU the RT work does not use")
def test_reef_pads_best_effort_on_cpus_the_rt_work_does_not_need(tmp_path):
    events, be_out, _ = run_gated(tmp_path, "reef", be_then_rt("gate_rt", seen("done", "rt")), rt_cpus=(1,))
    seq = kinds(events)
    # BE on CPU 0 runs on, never preempted, while RT work runs on CPU 1
    assert seq.index(("start", "rt")) < seq.index(("done", "be"))
    assert seq.count(("done", "be")) == 1 and ("preempt", "be") not in seq
    assert be_out.outputs[0].ravel().tolist() == [BE_KEY]


def test_seq_never_interrupts_best_effort(tmp_path):
    # both calls are in when the BE batch is let go: the RT request waited for it
    events, _, _ = run_gated(tmp_path, "seq", be_then_rt("gate_rt", lambda s: s.monitor.in_flight == 2))
    assert kinds(events) == [("start", "be"), ("done", "be"), ("start", "rt"), ("done", "rt")]


def test_seq_offers_no_direct_path_so_its_scheduler_sees_every_batch(tmp_path):
    async def scenario(server, gates):
        return server.config.transports.fast_direct, server.runtime("gate_rt").describe()["direct"]

    assert run_gated(tmp_path, "seq", scenario) == (False, [])


def test_concurrent_runs_side_by_side_without_preemption(tmp_path):
    events, _, _ = run_gated(tmp_path, "concurrent", be_then_rt("gate_rt", seen("done", "rt")))
    seq = kinds(events)
    assert seq.index(("start", "rt")) < seq.index(("done", "be"))
    assert not any(k in ("preempt", "preempted") for k, _ in seq)


def test_mixed_load_every_request_answered_exactly_once(tmp_path):
    async def scenario(server):
        calls = []
        for i in range(24):
            calls.append(server.infer("resnet152", [image("resnet152", 2, seed=i)], cls="be"))
            calls.append(server.infer("vgg19", [image("vgg19", 1, seed=i)], cls="be"))
            if i % 3 == 0:
                calls.append(server.infer("vgg19", [image("vgg19", 1, seed=100 + i)], cls="rt"))
                calls.append(server.infer("resnet152", [image("resnet152", 1, seed=100 + i)], cls="rt"))
        results = await asyncio.gather(*calls)
        return results, server.monitor.in_flight, dict(server.monitor.outcomes), list(server.coordinator.events)

    results, in_flight, outcomes, events = run_server(tmp_path, "reef", scenario)
    assert len(results) == 64 and in_flight == 0
    assert outcomes["ok"] == outcomes["accepted"] == 64
    for e in events:
        assert e.kind in ("start", "resume", "preempt", "preempted", "done")
    done = [(e.model, e.batch) for e in events if e.kind == "done"]
    assert len(done) == len(set(done))  # no batch finished twice


def test_rt_only_refuses_best_effort(tmp_path):
    async def scenario(server):
        from splitserve.errors import Refused

        with pytest.raises(Refused, match="rt-only"):
            await server.infer("vgg19", [image("vgg19", 1)], cls="be")
        return await server.infer("vgg19", [image("vgg19", 1)], cls="rt")

    assert run_server(tmp_path, "rt-only", scenario).outputs[0].shape == (1, 1000)


def test_reef_a_direct_rt_call_holds_direct_be_work_on_its_cpus_at_a_boundary(tmp_path):
    """REEF over the direct path: a real-time batch that a worker took straight from a
    client claims its CPUs; the coordinator hears of it (its page, and its doorbell once
    both classes are about) and holds the best-effort batch that another worker took
    directly on the same CPU at its next segment boundary, then lets it finish once the
    real-time work is done. The gate keeps both batches mid-run, so the order is forced."""
    from splitserve import Client
    from splitserve.bench.ownserver import get_json
    from splitserve.models.gate import Gates
    from tests.helpers import start_server
    from tests.framing import describe, direct_env, raw
    from tests.inproc import write_model

    for name, cls in (("gate_be", "be"), ("gate_rt", "rt")):
        write_model(tmp_path / "repo", name, "gate", f'cpus = [0]\nshare_cpus = true\ndefault_class = "{cls}"')
    gates = Gates(tmp_path / "cache")
    s = start_server(tmp_path / "data", "--repository", str(tmp_path / "repo"), "--load", "gate_be", "--load",
                     "gate_rt", cache_dir=tmp_path / "cache", http=True, env=direct_env())
    try:
        gates.close(9001)
        gates.close(9002)
        with Client(s.tcp, direct=True) as c:


            be = c.submit("gate_be", np.array([9001], np.int64))
            wait_until("the best-effort sample is at its gate", lambda: gates.held(9001))
            rt = c.submit("gate_rt", np.array([9002], np.int64))
            wait_until("the real-time sample is at its gate", lambda: gates.held(9002))
            assert c.direct_endpoints("gate_be") == c.direct_endpoints("gate_rt") == 1

            def events():
                return get_json(f"{s.http}/v2/scheduler/events")["events"]

            def counts(model):
                with raw(s) as r:  # a fresh lookup: its direct counters now
                    return describe(r, model)["direct_counts"]

            wait_until("the coordinator preempts the direct best-effort batch",
                  lambda: any(e["kind"] == "preempt" and e["model"] == "gate_be" for e in events()))
            gates.open(9001)  # segment 0 ends; the boundary holds it while the real-time batch runs
            wait_until("the best-effort batch stops at its boundary", lambda: counts("gate_be")["preempted"] == 1)
            assert counts("gate_be")["answered"] == 0  # held while the real-time sample is
            gates.open(9002)
            assert rt.result(timeout=60).value().ravel().tolist() == [9002]
            assert be.result(timeout=60).value().ravel().tolist() == [9001]
            (stats,) = get_json(f"{s.http}/v2/models/gate_be/stats")["model_stats"]
            assert stats["direct"]["answered"] == 1 and stats["direct"]["preempted"] == 1  # the front end's view
    finally:
        gates.open_all()
        s.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs real-time work on a CPU of its own")
def test_reef_a_front_end_preemption_does_not_release_a_held_direct_batch_on_the_same_worker(tmp_path):
    """Two authorities share a worker's preemption page: the front end's preemption of a
    front-end batch and the hold on the worker's own direct best-effort batch. Here the
    direct batch is held (real-time work runs), the same worker then takes a front-end
    best-effort batch, and the front end preempts that one: the direct batch must stay held
    while real-time work still runs (it resumed at once when both shared one word)."""
    from splitserve import Client
    from splitserve.bench.ownserver import get_json
    from splitserve.models.gate import Gates
    from splitserve.protocol.header import Header, Kind
    from splitserve.worker.messages import DIRECT_BATCH
    from tests.helpers import start_server
    from tests.framing import describe, direct_env, raw, read_frame, stream
    from tests.inproc import write_model

    for name, cls, cpu in (("gate_be", "be", 0), ("gate_rt", "rt", 0), ("gate_x", "rt", 1)):
        write_model(tmp_path / "repo", name, "gate", f'cpus = [{cpu}]\nshare_cpus = true\ndefault_class = "{cls}"')
    gates = Gates(tmp_path / "cache")
    s = start_server(tmp_path / "data", "--repository", str(tmp_path / "repo"), "--load", "gate_be", "--load",
                     "gate_rt", "--load", "gate_x", cache_dir=tmp_path / "cache", http=True, env=direct_env())
    try:
        for k in (9001, 9002, 9003, 9004, 9005):
            gates.close(k)
        with Client(s.tcp) as c, Client(s.tcp, direct=False) as front:


            def events(kind):
                return [e for e in get_json(f"{s.http}/v2/scheduler/events")["events"]
                        if e["kind"] == kind and e["model"] == "gate_be"]

            def counts():
                with raw(s) as r:  # a fresh lookup: the direct counters now
                    return describe(r, "gate_be")["direct_counts"]

            be = c.submit("gate_be", np.array([9001], np.int64))
            wait_until("the direct best-effort sample is at its gate", lambda: gates.held(9001))
            rt = c.submit("gate_rt", np.array([9002], np.int64))
            wait_until("the coordinator holds the direct best-effort batch", lambda: events("preempt"))
            other = c.submit("gate_x", np.array([9004], np.int64))  # real-time work on CPU 1, running on
            wait_until("the real-time sample on CPU 1 is at its gate", lambda: gates.held(9004))
            gates.open(9001)
            wait_until("the direct batch stops at its boundary", lambda: counts()["preempted"] == 1)
            gates.open(9002)
            assert rt.result(timeout=60).value().ravel().tolist() == [9002]
            # CPU 0 is free of real-time work: the same worker takes a front-end best-effort batch...
            fe = front.submit("gate_be", np.array([9003], np.int64), cls="be")
            wait_until("the front-end batch is at its gate", lambda: gates.held(9003))
            rt2 = c.submit("gate_rt", np.array([9005], np.int64))  # ...which real-time work on CPU 0 preempts
            wait_until("the front end preempts its batch",
                  lambda: any(e["batch"] != DIRECT_BATCH for e in events("preempt")))
            gates.open(9003)
            wait_until("the front-end batch stops at its boundary", lambda: events("preempted"))
            # One round trip through the worker's loop: it has done whatever it does after
            # stopping the front-end batch (resuming the direct batch, if it may).
            d, fid = stream(s, "direct", "gate_be")
            with d:
                d.sendall(Header(Kind.PING, req_id=1, func_id=fid).pack())
                assert read_frame(d)[0].kind == Kind.PONG
            assert counts()["answered"] == 0  # still held: real-time work runs on CPUs 0 and 1
            gates.open(9004)
            gates.open(9005)
            assert other.result(timeout=60).value().ravel().tolist() == [9004]
            assert rt2.result(timeout=60).value().ravel().tolist() == [9005]
            assert be.result(timeout=60).value().ravel().tolist() == [9001]
            assert fe.result(timeout=60).value().ravel().tolist() == [9003]
    finally:
        gates.open_all()
        s.stop()


def test_a_direct_best_effort_batch_held_past_max_call_age_is_answered_internal_once(tmp_path):
    """The watchdog on the direct path: a best-effort batch that a worker took directly and
    REEF holds at its boundary for a real-time batch that never ends is answered INTERNAL
    once max_call_age_s has passed since its call arrived; the real-time call, once it
    ends, gets its result."""
    from splitserve import Client
    from splitserve.bench.ownserver import get_json
    from splitserve.errors import InternalError
    from tests.helpers import start_server

    for name, cls in (("gate_be", "be"), ("gate_rt", "rt")):
        write_model(tmp_path / "repo", name, "gate", f'cpus = [0]\nshare_cpus = true\ndefault_class = "{cls}"')
    gates = Gates(tmp_path / "cache")
    s = start_server(tmp_path / "data", "--repository", str(tmp_path / "repo"), "--load", "gate_be", "--load",
                     "gate_rt", cache_dir=tmp_path / "cache", http=True,
                     env={**os.environ, "SPLITSERVE_MAX_CALL_AGE_S": "1.0"})
    try:
        gates.close(9011)
        gates.close(9012)
        with Client(s.tcp) as c:  # direct: the defaults


            be = c.submit("gate_be", np.array([9011], np.int64))
            wait_until("the best-effort sample is at its gate", lambda: gates.held(9011))
            rt = c.submit("gate_rt", np.array([9012], np.int64))
            wait_until("the real-time sample is at its gate", lambda: gates.held(9012))
            assert c.direct_endpoints("gate_be") == c.direct_endpoints("gate_rt") == 1
            wait_until("the coordinator preempts the direct best-effort batch",
                  lambda: any(e["kind"] == "preempt" and e["model"] == "gate_be"
                              for e in get_json(f"{s.http}/v2/scheduler/events")["events"]))
            gates.open(9011)  # segment 0 ends; the boundary holds it while the real-time batch runs
            with pytest.raises(InternalError, match="max_call_age_s"):
                be.result(timeout=60)
            gates.open(9012)
            assert rt.result(timeout=60).value().ravel().tolist() == [9012]
            (stats,) = get_json(f"{s.http}/v2/models/gate_be/stats")["model_stats"]
            assert stats["direct"]["failed"] == 1 and stats["direct"]["answered"] == 0
            assert stats["direct"]["in_flight_be"] == 0
    finally:
        gates.open_all()
        s.stop()
