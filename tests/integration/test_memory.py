"""The memory manager on real servers (Rafiqi §3.4, notes/rafiqi.md §5 checks 6-10, 13):
distinct-seed copies swap without mixing weights, loads follow a reference LRU, the budget
holds while thrashing, a preempted batch is never evicted under it, a worker killed
mid-load releases its reservation, and the high-concurrency swapping the paper could not
benchmark answers every request once."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from splitserve import Client
from splitserve.client.http import HttpClient
from splitserve.errors import DeadlineMissed, ModelNotReady, SplitServeError
from splitserve.models.loader import load_artifact
from splitserve.models.gate import LOAD_KEY, Gates
from splitserve.worker.pool import Residency as WorkerResidency
from tests.inproc import quiet_config, run_server, until, write_model

BOUND_S = 120.0  # no scenario needs this long; reaching it means something hangs
SWAPS_PER_MODEL = 2  # the high-concurrency test sends until the server loaded each copy this often on average


def lenet_copies(repo: Path, n: int, toml: str = "") -> list[str]:
    """``n`` LeNets with distinct seeds (a swap that mixed weights up answers wrong)."""
    names = []
    for seed in range(n):
        name = f"lenet{seed}"
        d = repo / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.toml").write_text(f'name = "{name}"\nmax_batch_size = 4\n{toml}\n'
                                       f'[artifact]\nkind = "zoo"\narch = "lenet"\nseed = {seed + 1}\n')
        names.append(name)
    return names


def reference(seed: int, xs: np.ndarray) -> np.ndarray:
    """That copy's output, computed here."""
    model = load_artifact("zoo", None, "lenet", seed=seed)
    with torch.inference_mode():
        (y,) = model(torch.from_numpy(xs))
    return y.numpy()


def reference_lru_misses(requests: list[str], capacity: int) -> int:
    cache: OrderedDict[str, None] = OrderedDict()
    misses = 0
    for r in requests:
        if r in cache:
            cache.move_to_end(r)
            continue
        misses += 1
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[r] = None
    return misses


def weights_bytes() -> int:
    return sum(t.nbytes for t in load_artifact("zoo", None, "lenet").state_dict().values())


def key(k: int) -> list[np.ndarray]:
    return [np.array([[k]], np.int64)]


def test_five_copies_with_room_for_four_swap_right_follow_the_lru_and_keep_the_budget(tmp_path):
    """Three rounds of the sequential pattern (every request a miss): each answer is its own
    copy's, the loads are the reference LRU's misses, and reserved bytes, sampled every
    10 ms, never exceed the budget. Then one request to an evicted model: exactly one load."""
    names = lenet_copies(tmp_path / "repo", 5)
    # Room for four by count; the bytes leave each copy its weights plus what a worker's
    # load measures on top (private bytes: about 1 MiB for lenet, noisy), so the count binds.
    budget = 4 * (weights_bytes() + (16 << 20))
    cfg = quiet_config(tmp_path / "data", repository=tmp_path / "repo", cache_dir=tmp_path / "cache",
                       max_resident_models=4, memory_budget_bytes=budget, spare_workers=1)
    xs = np.random.default_rng(0).integers(0, 256, (2, 1, 28, 28), dtype=np.uint8)
    want = {name: reference(seed + 1, xs) for seed, name in enumerate(names)}
    sequence = names * 3

    async def scenario(server):
        reserved: list[int] = []
        sampling = True

        async def sample() -> None:
            while sampling:
                reserved.append(server.memory.status()["reserved_bytes"])
                await asyncio.sleep(0.01)

        sampler = asyncio.ensure_future(sample())
        got = []
        for name in sequence:
            got.append((name, (await server.infer(name, [xs])).outputs[0]))
        sampling = False
        await sampler
        before = server.memory.status()
        victim = before["models"][names[0]]
        assert victim["residency"] == "EVICTED" and names[0] not in before["lru"]
        assert server.model_ready(names[0])  # served without an explicit load, resident or not
        again = (await server.infer(names[0], [xs])).outputs[0]
        after = server.memory.status()
        samples = {(s.name, s.labels.get("model")): s.value
                   for f in text_string_to_metric_families(server.metrics_text().decode()) for s in f.samples}
        assert samples[("splitserve_model_loads_total", names[0])] == 4
        assert samples[("splitserve_model_evictions_total", names[0])] == 3
        assert samples[("splitserve_memory_budget_bytes", None)] == budget
        assert samples[("splitserve_model_load_seconds_count", names[0])] == 4
        return got, reserved, before, after, again

    got, reserved, before, after, again = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    for name, y in got:
        np.testing.assert_allclose(y, want[name], rtol=1e-4, atol=1e-5)
    assert before["loads"] == reference_lru_misses(sequence, 4) == 15
    assert before["evictions"] == 15 - 4 and len(before["lru"]) == 4
    assert reserved and max(reserved) <= budget
    np.testing.assert_allclose(again, want[names[0]], rtol=1e-4, atol=1e-5)
    assert after["loads"] == before["loads"] + 1
    assert after["models"][names[0]]["loads"] == before["models"][names[0]]["loads"] + 1


def test_a_preempted_batch_is_not_evicted_until_it_has_resumed_and_finished(tmp_path, caplog):
    """REEF and the memory manager: ``gate`` (best-effort) is preempted by real-time work on
    its CPU while a third model needs its place; it is evicted only after its batch resumed
    and finished, and every call is answered. The third model is named at start-up too (by
    ``*``, every registered model), but only two fit: it is skipped then (logged with why),
    not loaded to evict the first."""
    repo = tmp_path / "repo"
    write_model(repo, "gate", "gate", "cpus = [0]\nshare_cpus = true")
    write_model(repo, "rtgate", "gate", 'cpus = [0]\nshare_cpus = true\ndefault_class = "rt"\n'
                                        "[memory]\nkeep_resident = true")
    write_model(repo, "other", "lenet")
    gates = Gates(tmp_path / "cache")
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=tmp_path / "cache", preemption="reef",
                       max_resident_models=2, load=("gate", "rtgate", "*"))

    async def scenario(server):
        assert server.preloaded == ("gate", "rtgate") and server.ready()
        events = server.coordinator.events
        assert not any(e.kind == "evict_start" for e in events)
        gates.close(1)
        gates.close(2)
        be = asyncio.ensure_future(server.infer("gate", key(1), cls="be"))
        await until(lambda: gates.held(1))
        rt = asyncio.ensure_future(server.infer("rtgate", key(2), cls="rt"))
        await until(lambda: any(e.kind == "preempt" and e.model == "gate" for e in events))
        gates.open(1)  # gate's segment 0 ends; it stops at the boundary, suspended
        await until(lambda: any(e.kind == "preempted" and e.model == "gate" for e in events))
        other = asyncio.ensure_future(server.infer("other", [np.zeros((1, 1, 28, 28), np.uint8)]))
        await until(lambda: server.memory.status()["load_queue"] == ["other"])
        assert not any(e.kind == "evict_start" for e in events)  # both residents are busy (or kept)
        gates.open(2)  # the RT batch ends; gate resumes, finishes, and only then goes
        outs = await asyncio.gather(be, rt, other)
        return outs, [(e.kind, e.model) for e in events]

    try:
        with caplog.at_level(logging.WARNING, logger="splitserve"):
            outs, log = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    finally:
        gates.open_all()
    assert any("start-up model other not preloaded: max_resident_models 2 reached by gate, rtgate" in r.getMessage()
               for r in caplog.records)
    assert outs[0].outputs[0].tolist() == [[1]] and outs[1].outputs[0].tolist() == [[2]]
    gate_log = [kind for kind, model in log if model == "gate"]
    order = [gate_log.index(k) for k in ("preempted", "resume", "done", "evict_start")]
    assert order == sorted(order), gate_log
    assert ("evict_start", "rtgate") not in log  # keep_resident
    assert log.index(("evict_done", "gate")) < log.index(("load_start", "other"))


def test_a_model_loaded_for_waiting_calls_serves_them_before_it_can_be_evicted(tmp_path):
    """With one place and two models waiting, the first to load is not the next one's
    victim before it has started a batch (else swaps undo each other before serving)."""
    repo = tmp_path / "repo"
    write_model(repo, "gate", "gate")
    names = lenet_copies(repo, 2)
    gates = Gates(tmp_path / "cache")
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=tmp_path / "cache", max_resident_models=1,
                       load=("gate",))
    x = [np.zeros((1, 1, 28, 28), np.uint8)]

    async def scenario(server):
        gates.close(1)
        held = asyncio.ensure_future(server.infer("gate", key(1)))
        await until(lambda: gates.held(1))  # the one resident model is busy: both copies wait
        waiting = [asyncio.ensure_future(server.infer(n, x)) for n in names]
        await until(lambda: sorted(server.memory.status()["load_queue"]) == sorted(names))
        # in the order their footprints were read, off the loop: either may come first
        queue = server.memory.status()["load_queue"]
        gates.open(1)
        await asyncio.gather(held, *waiting)
        return [(e.kind, e.model) for e in server.coordinator.events], queue

    try:
        log, (first, second) = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    finally:
        gates.open_all()
    assert log.index(("start", first)) < log.index(("evict_start", first)) < log.index(("load_start", second))


def test_a_worker_killed_mid_load_releases_the_reservation_and_the_waiting_calls_are_answered(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "gate", "gate")
    write_model(repo, "lenet", "lenet")
    gates = Gates(tmp_path / "cache")
    cfg = quiet_config(tmp_path / "data", repository=repo, cache_dir=tmp_path / "cache", max_resident_models=1,
                       worker_start_attempts=1)

    async def scenario(server):
        gates.close(LOAD_KEY)  # the gate's worker holds in its LOAD
        waiting = [asyncio.ensure_future(server.infer("gate", key(k))) for k in (1, 2)]
        rt = server.runtime("gate")
        await until(lambda: any(h.residency is WorkerResidency.LOADING for h in rt.workers.values()))
        assert server.memory.status()["loading"] == ["gate"]
        late = await asyncio.gather(server.infer("gate", key(3), deadline_s=0.05), return_exceptions=True)
        assert isinstance(late[0], DeadlineMissed)  # a deadline still applies while its call waits for a load
        (pid,) = [h.pid for h in rt.workers.values()]
        os.kill(pid, signal.SIGKILL)
        answers = await asyncio.gather(*waiting, return_exceptions=True)
        status = server.memory.status()
        gates.open(LOAD_KEY)
        other = (await server.infer("lenet", [np.zeros((1, 1, 28, 28), np.uint8)])).outputs[0]
        return answers, status, other

    try:
        answers, status, other = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S))
    finally:
        gates.open_all()
    assert all(isinstance(a, ModelNotReady) for a in answers), answers
    assert status["reserved_bytes"] == 0 and status["loading"] == [] and status["lru"] == []
    assert status["models"]["gate"]["residency"] == "FAILED" and status["models"]["gate"]["reason"]
    assert other.shape == (1, 10)  # the loader was free for the next model


def test_32_clients_over_8_models_with_2_resident_fast_path_and_http_are_answered_once_and_right(tmp_path):
    """Rafiqi §5.0.2's untested case: highly concurrent model swapping."""
    names = lenet_copies(tmp_path / "repo", 8)
    cfg = quiet_config(tmp_path / "data", repository=tmp_path / "repo", cache_dir=tmp_path / "cache",
                       max_resident_models=2, spare_workers=1).replaced(fast_port=0, http_port=0)
    xs = np.random.default_rng(1).integers(0, 256, (4, 1, 28, 28), dtype=np.uint8)
    want = {name: reference(seed + 1, xs) for seed, name in enumerate(names)}
    clients = 32

    answered = [0] * clients  # per client, read by the scenario to know every client took part

    def client(i: int, url: str, http: bool, stop: threading.Event, tally: list) -> None:
        rng = random.Random(i)
        sent = ok = 0
        wrong: list[str] = []
        errors: list[str] = []
        with (HttpClient(url) if http else Client(url)) as c:
            while not stop.is_set():
                name, k = rng.choice(names), rng.randrange(len(xs))
                sent += 1
                try:
                    y = c.infer(name, xs[k:k + 1])
                except SplitServeError as e:
                    errors.append(f"{name}: {e}")
                    continue
                ok += 1
                answered[i] += 1
                if not np.allclose(y, want[name][k:k + 1], rtol=1e-4, atol=1e-5):
                    wrong.append(name)
        tally.append((sent, ok, wrong, errors))

    async def scenario(server):
        tcp = f"tcp://127.0.0.1:{server.ports['fast_port']}"
        http = f"http://127.0.0.1:{server.ports['http_port']}"
        token = (server.config.data_dir / "token").read_text().strip()
        with HttpClient(http, token=token) as h:  # one copy is kept: the other seven share one place
            await asyncio.to_thread(h.load, names[0], keep_resident=True)
        stop, tally = threading.Event(), []
        threads = [threading.Thread(target=client, args=(i, http if i % 2 else tcp, bool(i % 2), stop, tally))
                   for i in range(clients)]
        for t in threads:
            t.start()
        # until the copies really swapped under this concurrency, and every client was answered
        entries = server.memory.cache.entries
        await until(lambda: sum(e.loads for e in entries.values()) >= SWAPS_PER_MODEL * len(names)
                    and min(answered) >= 2)
        stop.set()
        await asyncio.gather(*(asyncio.to_thread(t.join) for t in threads))
        await until(lambda: server.monitor.in_flight == 0)
        crashed = [rt.name for rt in server.runtimes.values() if rt.stats.failure]
        with HttpClient(http) as h:
            status = await asyncio.to_thread(h.memory)
            ready = await asyncio.to_thread(lambda: [h.ready(n) for n in names])
        return tally, status, crashed, ready

    tally, status, failed, ready = run_server(cfg, lambda s: asyncio.wait_for(scenario(s), BOUND_S + 60))
    assert len(tally) == clients
    assert sum(t[0] for t in tally) == sum(t[1] for t in tally) > clients, [t[3][:3] for t in tally if t[3]]
    assert not [w for t in tally for w in t[2]]
    assert not failed
    assert status["loads"] > len(names) and status["evictions"] > 0  # it really swapped
    assert len(status["lru"]) <= 2 and names[0] in status["lru"]
    assert status["models"][names[0]]["keep_resident"] and status["models"][names[0]]["evictions"] == 0
    assert all(ready)  # every copy is ready (served without an explicit load), resident or not
    assert set(status) == {"budget_bytes", "max_resident_models", "max_concurrent_loads", "reserved_bytes",
                           "resident_bytes", "lru", "loading", "load_queue", "spares", "spares_starting", "loads",
                           "evictions", "models",
                           "device_budget_bytes", "device_reserved_bytes", "pinned_tier_budget_bytes",
                           "pinned_tier_bytes", "pinned_tier"}
    assert status["device_reserved_bytes"] == {}  # CPU models hold no device memory
    assert status["pinned_tier"] == [] and status["pinned_tier_bytes"] == 0  # and never park
    assert set(names) <= set(status["models"]) and set(status["models"][names[0]]) == {
        "residency", "reason", "weights_bytes", "private_bytes", "reserved_bytes", "instances", "loads", "evictions",
        "last_load_ms", "keep_resident", "last_used_s_ago", "device_bytes", "device_reserved_bytes", "pinned_bytes"}


def test_a_start_up_model_larger_than_the_byte_budget_is_not_preloaded_and_the_start_says_why(tmp_path, caplog):
    """Its size is read from its weights before any load (a seeded resnet18: about 43 MiB,
    against a 20 MiB budget), so nothing loads at start, the node is ready, and the log
    names the model, the bytes and the budget."""
    write_model(tmp_path / "repo", "big", "resnet18")
    cfg = quiet_config(tmp_path / "data", repository=tmp_path / "repo", cache_dir=tmp_path / "cache",
                       memory_budget_bytes=20 << 20, load=("big",))

    async def scenario(server):
        return server.preloaded, server.ready(), server.memory.status()["loads"]

    with caplog.at_level(logging.WARNING, logger="splitserve"):
        assert run_server(cfg, scenario) == ((), True, 0)
    assert any(m.startswith("start-up model big not preloaded: needs 0.04 GiB of host memory; 0.02 GiB of the "
                            "0.02 GiB budget is left (estimated: not loaded on this node before)")
               for m in (r.getMessage() for r in caplog.records))
