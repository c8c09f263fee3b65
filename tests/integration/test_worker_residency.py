"""Worker residency: a worker binds a model by LOAD (its queue memfds over SCM_RIGHTS, its
weights from the artifact), serves it, releases it by UNLOAD (mappings, fds, memory) and
binds another; a RUN with nothing bound and a bad LOAD are answered FAILED and leave the
worker usable. In-process workers over a socketpair check the message logic and what is
left behind; real worker processes, driven through ``WorkerHandle``, check the rest."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from splitserve.config import ReefSection, ServerConfig, WorkerSection
from splitserve.modelconfig import ModelConfig
from splitserve.models.zoo import build_zoo_model
from splitserve.protocol.header import RequestClass
from splitserve.scheduler.model_scheduler import CLASSES
from splitserve.tensorqueue import TensorQueue, ring_slots
from splitserve.worker.messages import (MAX_MESSAGE_BYTES, DoneMsg, FailedMsg, LoadedMsg, LoadMsg, Msg, RunMsg,
                                        UnloadedMsg)
from splitserve.worker.pool import Residency, WorkerHandle
from splitserve.worker.preempt_flag import PreemptFlag
from splitserve.worker.process import Worker
from splitserve.worker.spec import BindSpec, QueueFds, WorkerSpec

BE = int(RequestClass.BE)
EVENT_TIMEOUT_S = 120.0  # a bound on each wait, so a broken worker fails the test instead of hanging it


def zoo(name: str) -> ModelConfig:
    return ModelConfig.from_dict({"name": name, "artifact": {"kind": "zoo", "arch": name}})


class Queues:
    """A model's tensor queues on the front end's side, one set per class, as a runtime
    makes them; ``tag`` names their memfds so a test can find them in /proc."""

    def __init__(self, cfg: ModelConfig, tag: str, nslots: int | None = None) -> None:
        self.cfg = cfg
        self.tag = tag
        self.n = nslots or ring_slots([t.nbytes for t in cfg.inputs + cfg.outputs], 8)
        self.tqs = {c: ([TensorQueue(t.nbytes, self.n, name=f"{tag}-{c.name}-in-{t.name}") for t in cfg.inputs],
                        [TensorQueue(t.nbytes, self.n, name=f"{tag}-{c.name}-out-{t.name}") for t in cfg.outputs])
                    for c in CLASSES}

    def bind(self, model_dir: Path | None = None, nslots: int | None = None) -> BindSpec:
        return BindSpec(self.cfg.to_dict(), str(model_dir) if model_dir else None,
                        {str(int(c)): QueueFds(nslots or self.n, [q.fd for q in ins], [q.fd for q in outs])
                         for c, (ins, outs) in self.tqs.items()}, self.cfg.capacity,
                        threads=torch.get_num_threads())  # in-process workers leave the test's threads as they are

    def put(self, seq: int, x: np.ndarray) -> None:
        spec = self.cfg.inputs[0]
        self.tqs[RequestClass.BE][0][0].array(seq, len(x), spec.dtype, spec.shape)[:] = x

    def out(self, seq: int, count: int) -> np.ndarray:
        spec = self.cfg.outputs[0]
        return self.tqs[RequestClass.BE][1][0].array(seq, count, spec.dtype, spec.shape)

    def close(self) -> None:
        for ins, outs in self.tqs.values():
            for q in ins + outs:
                q.close()


def sample(cfg: ModelConfig, n: int, seed: int = 0) -> np.ndarray:
    spec = cfg.inputs[0]
    rng = np.random.default_rng(seed)
    if spec.dtype == np.uint8:
        return rng.integers(0, 256, (n, *spec.shape), dtype=np.uint8)
    return rng.standard_normal((n, *spec.shape)).astype(spec.dtype)


def expected(name: str, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        (y,) = build_zoo_model(name)(torch.from_numpy(x))
    return y.numpy()


def param_bytes(name: str) -> int:
    m = build_zoo_model(name)
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def own(what: str, pid: int | str = "self") -> list[str]:
    """Lines of /proc/<pid>/maps, or the targets of /proc/<pid>/fd links."""
    if what == "maps":
        return Path(f"/proc/{pid}/maps").read_text().splitlines()
    fd_dir = Path(f"/proc/{pid}/fd")
    out = []
    for p in fd_dir.iterdir():
        try:
            out.append(os.readlink(p))
        except FileNotFoundError:  # the fd of the listing itself, closed since
            pass
    return out


def memfd_maps(pid: int | str = "self") -> list[str]:
    return sorted(line for line in own("maps", pid) if "/memfd:" in line)


def mentions(lines: list[str], tag: str) -> int:
    return sum(f"splitserve-{tag}-" in line for line in lines)


# ---- in-process: the message logic, and what a worker leaves behind ----


@contextmanager
def unbound_worker(cache_dir: Path) -> Iterator[tuple[Worker, socket.socket]]:
    """A Worker started with no model, and the front end's end of its control socket."""
    flag = PreemptFlag()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spec = WorkerSpec(ctrl_fd=theirs.detach(), flag_fd=flag.fd, cache_dir=str(cache_dir),
                      log_level=ServerConfig.log_level, segment_time_weight=ReefSection.segment_time_weight)
    w = Worker(spec)
    try:
        yield w, ours
    finally:
        w.unload()
        w.ctrl.close()
        flag.close()
        ours.close()


def ask(w: Worker, sock: socket.socket, data: bytes, fds: list[int] = ()) -> bytes:  # type: ignore[assignment]
    """Send one message, let the worker answer it, and return the answer."""
    socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    assert w.step()
    return sock.recv(65536)


def test_inproc_load_run_unload_maps_once_and_releases_every_fd_and_mapping(tmp_path):
    cfg = zoo("lenet")
    q = Queues(cfg, "inproc-lenet")
    try:
        with unbound_worker(tmp_path) as (w, sock):
            fds0, maps0 = mentions(own("fd"), q.tag), mentions(own("maps"), q.tag)
            data, fds = LoadMsg(1, q.bind()).pack()
            loaded = LoadedMsg.unpack(ask(w, sock, data, fds))
            assert loaded.binding == 1 and loaded.model == "lenet"
            # the worker holds its own fd and its double mapping of every queue
            assert mentions(own("fd"), q.tag) == fds0 + len(fds)
            assert mentions(own("maps"), q.tag) == 2 * maps0
            x = sample(cfg, 3)
            q.put(5, x)
            for bid in (1, 2):  # serving maps nothing more
                done = DoneMsg.unpack(ask(w, sock, RunMsg(BE, bid, 5, 3).pack()))
                assert (done.kind, done.batch_id) == (Msg.DONE, bid)
                assert mentions(own("maps"), q.tag) == 2 * maps0
            np.testing.assert_allclose(q.out(5, 3), expected("lenet", x), rtol=1e-5, atol=1e-6)
            assert UnloadedMsg.unpack(ask(w, sock, bytes([Msg.UNLOAD]))).binding == 1
            assert (mentions(own("fd"), q.tag), mentions(own("maps"), q.tag)) == (fds0, maps0)
            q.out(5, 3)[:] = -1
            refused = FailedMsg.unpack(ask(w, sock, RunMsg(BE, 3, 5, 3).pack()))
            assert (refused.op, refused.ident) == (Msg.RUN, 3) and "no model is bound" in refused.text
            assert (q.out(5, 3) == -1).all()  # nothing ran
            assert UnloadedMsg.unpack(ask(w, sock, bytes([Msg.UNLOAD]))).binding is None
    finally:
        q.close()


def test_inproc_park_keeps_the_binding_with_its_weights_in_host_memory_and_the_next_batch_reloads_them(tmp_path):
    cfg = zoo("lenet")
    q = Queues(cfg, "inproc-park")
    try:
        with unbound_worker(tmp_path) as (w, sock):
            maps0 = mentions(own("maps"), q.tag)
            data, fds = LoadMsg(1, q.bind()).pack()
            LoadedMsg.unpack(ask(w, sock, data, fds))
            x = sample(cfg, 3)
            q.put(5, x)
            assert DoneMsg.unpack(ask(w, sock, RunMsg(BE, 1, 5, 3).pack())).kind == Msg.DONE
            want = q.out(5, 3).copy()
            maps = mentions(own("maps"), q.tag)
            parked = UnloadedMsg.unpack(ask(w, sock, bytes([Msg.PARK])))
            assert parked.binding == 1 and parked.parked_bytes == param_bytes("lenet")
            assert all(t.numel() == 0 for t in w.model.parameters())  # the model's own copies are freed
            assert mentions(own("maps"), q.tag) == maps  # the binding stays: its queues stay mapped
            reloaded = LoadedMsg.unpack(ask(w, sock, bytes([Msg.RELOAD])))
            assert (reloaded.binding, reloaded.model, reloaded.load_ns, reloaded.private_bytes) == (1, "lenet", 0, None)
            q.out(5, 3)[:] = 0
            done = DoneMsg.unpack(ask(w, sock, RunMsg(BE, 2, 5, 3).pack()))
            assert (done.kind, done.batch_id, done.segments_run) == (Msg.DONE, 2, w.model.num_segments)
            np.testing.assert_array_equal(q.out(5, 3), want)  # the batch that brought the weights back
            assert w.bound is not None and w.bound.parked is None  # after its answer the host copy went
            for bid in (3, 4):  # served as before; then parked and reloaded once more
                q.out(5, 3)[:] = 0
                assert DoneMsg.unpack(ask(w, sock, RunMsg(BE, bid, 5, 3).pack())).kind == Msg.DONE
                np.testing.assert_array_equal(q.out(5, 3), want)
                if bid == 3:
                    assert UnloadedMsg.unpack(ask(w, sock, bytes([Msg.PARK]))).parked_bytes == parked.parked_bytes
                    assert LoadedMsg.unpack(ask(w, sock, bytes([Msg.RELOAD]))).binding == 1
            # RELOAD with nothing parked fails as a LOAD would, and leaves the worker unbound and usable
            failed = FailedMsg.unpack(ask(w, sock, bytes([Msg.RELOAD])))
            assert (failed.op, failed.ident) == (Msg.LOAD, 1) and "no parked model" in failed.text
            assert w.bound is None and mentions(own("maps"), q.tag) == maps0
            nothing = UnloadedMsg.unpack(ask(w, sock, bytes([Msg.PARK])))  # nothing bound: nothing parks
            assert (nothing.binding, nothing.parked_bytes) == (None, 0)
    finally:
        q.close()


@contextmanager
def bad_loads(q: Queues, tmp_path: Path) -> Iterator[dict[str, tuple[bytes, list[int]]]]:
    """LOADs a worker must refuse, by what is wrong with them (the fds stay open meanwhile)."""
    good, fds = LoadMsg(2, q.bind()).pack()
    short = Queues(q.cfg, "short")
    r, w = os.pipe()
    try:
        yield {
            "fewer fds than named": (good, fds[:-1]),
            "memfds smaller than their rings": LoadMsg(2, short.bind(nslots=2 * q.n)).pack(),
            "a pipe for a queue": LoadMsg(2, BindSpec(q.cfg.to_dict(), None, {"1": QueueFds(q.n, [r], [w])})).pack(),
            "an unknown config key": LoadMsg(2, BindSpec({**q.cfg.to_dict(), "colour": "red"}, None,
                                                         q.bind().queues)).pack(),
            "a missing artifact file": LoadMsg(2, BindSpec(
                {**q.cfg.to_dict(), "artifact": {"kind": "safetensors", "arch": "lenet", "file": "model.safetensors"}},
                str(tmp_path), q.bind().queues)).pack(),
        }
    finally:
        short.close()
        os.close(r)
        os.close(w)


def test_inproc_bad_loads_answer_failed_and_leave_no_fd_or_mapping(tmp_path):
    cfg = zoo("lenet")
    q = Queues(cfg, "inproc-bad")
    try:
        with unbound_worker(tmp_path) as (w, sock):
            with bad_loads(q, tmp_path) as bad:
                fds_before, maps_before = sorted(own("fd")), memfd_maps()
                for why, (data, fds) in bad.items():
                    failed = FailedMsg.unpack(ask(w, sock, data, fds))
                    assert (failed.op, failed.ident) == (Msg.LOAD, 2), why
                    assert failed.text, why
                    assert w.bound is None, why
                    assert (sorted(own("fd")), memfd_maps()) == (fds_before, maps_before), why
            data, fds = LoadMsg(3, q.bind()).pack()
            assert LoadedMsg.unpack(ask(w, sock, data, fds)).binding == 3
            again, fds = LoadMsg(4, q.bind()).pack()
            refused = FailedMsg.unpack(ask(w, sock, again, fds))
            assert (refused.op, refused.ident) == (Msg.LOAD, 4) and "UNLOAD it first" in refused.text
            assert w.bound is not None and w.bound.ident == 3  # the binding that was there still serves
            q.put(0, sample(cfg, 1))
            assert DoneMsg.unpack(ask(w, sock, RunMsg(BE, 1, 0, 1).pack())).kind == Msg.DONE
    finally:
        q.close()


def test_inproc_malformed_control_messages_are_answered_failed_and_leave_nothing_behind(tmp_path):
    r, w_ = os.pipe()
    try:
        with unbound_worker(tmp_path) as (w, sock):
            fds_before = sorted(own("fd"))
            cases = {
                "unknown kind": (b"\x63hello", [], 0x63),
                "a short RUN": (b"\x01\x01", [], Msg.RUN),
                "fds beside a RUN": (RunMsg(BE, 4, 0, 1).pack(), [r, w_], Msg.RUN),
                "fds beside an UNLOAD": (bytes([Msg.UNLOAD]), [r], None),
                "over the size limit": (bytes([Msg.LOAD]) + b"x" * MAX_MESSAGE_BYTES, [], Msg.LOAD),
            }
            for why, (data, fds, op) in cases.items():
                answer = ask(w, sock, data, fds)
                if op is None:
                    assert UnloadedMsg.unpack(answer).binding is None, why
                else:
                    assert FailedMsg.unpack(answer).op == op, why
                assert sorted(own("fd")) == fds_before, why  # fds that came with them were closed
    finally:
        os.close(r)
        os.close(w_)


# ---- real worker processes, through the front end's handle ----


class Recorder:
    """A WorkerOwner that queues what its worker reports, for a test to await in order."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def on_ready(self, instance: int, info: dict) -> None:
        self.events.put_nowait(("ready", info))

    def on_done(self, instance: int, msg: DoneMsg) -> None:
        self.events.put_nowait(("done", msg))

    def on_failed(self, instance: int, batch_id: int, text: str) -> None:
        self.events.put_nowait(("failed", (batch_id, text)))

    def on_loaded(self, instance: int, msg: LoadedMsg) -> None:
        self.events.put_nowait(("loaded", msg))

    def on_load_failed(self, instance: int, binding: int, text: str) -> None:
        self.events.put_nowait(("load_failed", (binding, text)))

    def on_unloaded(self, instance: int, msg: UnloadedMsg) -> None:
        self.events.put_nowait(("unloaded", msg))

    def on_exit(self, instance: int, handle: WorkerHandle) -> None:
        self.events.put_nowait(("exit", handle))

    async def next(self, kind: str) -> Any:
        got, value = await asyncio.wait_for(self.events.get(), EVENT_TIMEOUT_S)
        assert got == kind, (got, value)
        return value


def start(owner: Recorder, cache_dir: Path) -> WorkerHandle:
    """A worker process on one thread, bound to nothing."""

    def make_spec(ctrl_fd: int, flag_fd: int) -> WorkerSpec:
        return WorkerSpec(ctrl_fd=ctrl_fd, flag_fd=flag_fd, cache_dir=str(cache_dir),
                          log_level=ServerConfig.log_level, segment_time_weight=ReefSection.segment_time_weight)

    return WorkerHandle(owner, 0, make_spec, asyncio.get_running_loop(), WorkerSection.worker_reap_timeout_s)


async def run_and_check(owner: Recorder, h: WorkerHandle, q: Queues, batch_id: int, seq: int = 3) -> None:
    x = sample(q.cfg, 2, seed=batch_id)
    q.put(seq, x)
    assert h.send_run(RunMsg(BE, batch_id, seq, 2))
    done = await owner.next("done")
    assert (done.kind, done.batch_id) == (Msg.DONE, batch_id)
    np.testing.assert_allclose(q.out(seq, 2), expected(q.cfg.name, x), rtol=1e-4, atol=1e-5)


async def load(owner: Recorder, h: WorkerHandle, bind: BindSpec) -> LoadedMsg:
    assert h.send_load(bind)
    assert h.residency is Residency.LOADING
    loaded = await owner.next("loaded")
    assert h.residency is Residency.BOUND and loaded.binding == h.binding
    return loaded


async def unload(owner: Recorder, h: WorkerHandle) -> UnloadedMsg:
    assert h.send_unload()
    assert h.residency is Residency.UNLOADING
    msg = await owner.next("unloaded")
    assert h.residency is Residency.UNBOUND
    return msg


def test_a_worker_process_binds_a_model_serves_it_unloads_and_serves_another(tmp_path):
    """bind lenet → run → unload (mappings and fds gone; RUN refused, nothing run) →
    a corrupt artifact fails its LOAD → bind resnet18 → run, in one process."""
    lenet, resnet = Queues(zoo("lenet"), "proc-lenet"), Queues(zoo("resnet18"), "proc-resnet18")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    corrupt_cfg = {**zoo("lenet").to_dict(), "artifact": {"kind": "safetensors", "arch": "lenet",
                                                          "file": "model.safetensors"}}

    async def story() -> None:
        owner = Recorder()
        h = start(owner, tmp_path)
        try:
            info = await owner.next("ready")
            assert info["pid"] == h.pid and h.residency is Residency.UNBOUND and not h.ready
            with pytest.raises(RuntimeError, match="nothing to unload"):
                h.send_unload()
            pid = h.pid
            assert not mentions(own("maps", pid), lenet.tag)

            loaded = await load(owner, h, lenet.bind())
            assert loaded.model == "lenet" and loaded.load_ns > 0
            assert abs(loaded.nbytes - param_bytes("lenet")) <= 0.1 * param_bytes("lenet")
            assert mentions(own("maps", pid), lenet.tag) == 2 * 2 * 2  # 2 tensors x 2 classes, mapped twice
            assert h.ready
            with pytest.raises(RuntimeError, match="cannot load"):
                h.send_load(resnet.bind())
            await run_and_check(owner, h, lenet, batch_id=1)

            # parked and reloaded in the same process: the binding (and its mappings) stay
            with pytest.raises(RuntimeError, match="nothing to reload"):
                h.send_reload()
            assert h.send_unload(park=True) and h.residency is Residency.UNLOADING
            parked = await owner.next("unloaded")
            assert parked.binding == loaded.binding and parked.parked_bytes == param_bytes("lenet")
            assert h.residency is Residency.PARKED and h.binding == loaded.binding and not h.ready
            assert mentions(own("maps", pid), lenet.tag) == 2 * 2 * 2
            assert h.send_reload() and h.residency is Residency.LOADING
            assert (await owner.next("loaded")).binding == loaded.binding and h.ready
            await run_and_check(owner, h, lenet, batch_id=10)  # the batch that copies the weights back

            assert (await unload(owner, h)).binding == loaded.binding
            assert not mentions(own("maps", pid), lenet.tag)  # the rings are unmapped ...
            assert not mentions(own("fd", pid), lenet.tag)  # ... and their memfds closed
            lenet.out(3, 2)[:] = -1
            assert h.send_run(RunMsg(BE, 2, 3, 2))  # the handle does not guard: the worker must
            batch_id, text = await owner.next("failed")
            assert batch_id == 2 and "no model is bound" in text
            assert (lenet.out(3, 2) == -1).all()

            assert h.send_load(BindSpec(corrupt_cfg, str(corrupt), lenet.bind().queues))
            pending = h.binding
            binding, text = await owner.next("load_failed")
            assert binding == pending and h.binding is None
            assert "InvalidInput" in text and "safetensors" in text
            assert h.residency is Residency.UNBOUND and h.alive
            assert not mentions(own("maps", pid), lenet.tag) and not mentions(own("fd", pid), lenet.tag)

            h.flag.raise_for(3)  # left over from lenet's batches: it must not stop resnet18's batch 3
            h.flag.set_padding_deadline(1)
            loaded = await load(owner, h, resnet.bind())
            assert loaded.model == "resnet18" and h.pid == pid  # the same process, reused
            assert abs(loaded.nbytes - param_bytes("resnet18")) <= 0.1 * param_bytes("resnet18")
            await run_and_check(owner, h, resnet, batch_id=3)
        finally:
            await h.stop(WorkerSection.stop_timeout_s)

    try:
        asyncio.run(story())
    finally:
        lenet.close()
        resnet.close()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_an_unloaded_models_weights_go_back_to_the_system(tmp_path):
    """An unloaded model's weights go back to the system (the process shrinks), not only
    to the allocator."""
    big = [Queues(zoo(name), f"start-{name}") for name in ("resnet18", "resnet50")]

    async def story() -> None:
        owner = Recorder()
        h = start(owner, tmp_path)
        try:
            await owner.next("ready")
            # Two models: after the first one's large blocks are freed, glibc serves blocks
            # that size from its heap and keeps them when freed, unless the worker trims it.
            for batch_id, q in enumerate(big, start=2):
                loaded = await load(owner, h, q.bind())
                await run_and_check(owner, h, q, batch_id, seq=q.n - 1)  # the batch wraps the ring
                resident = rss(h.pid)
                await unload(owner, h)
                assert resident - rss(h.pid) >= loaded.nbytes // 2, q.cfg.name
        finally:
            await h.stop(WorkerSection.stop_timeout_s)

    try:
        asyncio.run(story())
    finally:
        for q in big:
            q.close()
