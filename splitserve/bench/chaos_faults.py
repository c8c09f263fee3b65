"""The chaos benchmark's faults: what a misbehaving client, a crash or an operator does.

Each fault is one coroutine that does its damage, returns a one-line result, and never
waits without a bound. ``FaultInjector`` runs them in turn during the chaos phase, each as
its own task (so a management call that hangs does not stop the next fault), records when
each happened and how the server reacted, and at the end closes every connection it held.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.bench.chaos_ledger import Ledger, StreamLane, status_name
from splitserve.protocol.header import HEADER_SIZE, MAX_PAYLOAD, Flags, Header, Kind, RequestClass, unpack_header
from splitserve.worker.forkserver import node_workers

logger = logging.getLogger(__name__)

FAULT_KINDS: tuple[str, ...] = ("kill_worker", "stall", "nonreader", "malformed_stream", "malformed_udp",
                                "resize", "reconfigure", "unload_load")
# How long a malformed frame's sender waits for the server's reaction (an error frame or a close).
_REACTION_S = 3.0


@dataclass
class FaultRecord:
    """One fault: when (run clock), what, on what, and how the server took it."""

    t: float
    kind: str
    target: str = ""
    result: str = "running"
    took_s: float | None = None
    findings: list[str] = field(default_factory=list)  # server behaviour that breaks a promise


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _frame(kind: int = Kind.REQUEST, *, func_id: int = 0, payload_len: int = 0, cls: int = RequestClass.BE,
           req_id: int = 1, version: int | None = None, magic: bytes | None = None, **kw: Any) -> bytes:
    h = Header(kind, req_id=req_id, func_id=func_id, cls=cls, payload_len=payload_len, **kw)
    if version is not None:
        h.version = version
    b = bytearray(h.pack())
    if magic is not None:
        b[:4] = magic
    return bytes(b)


class FaultInjector:
    """Runs faults against one server during the chaos phase and keeps their records."""

    def __init__(self, urls: dict[str, str], server_pid: int, token: str | None, models: Sequence[str],
                 clock: Callable[[], float], hold_s: float, call_timeout_s: float, nonreader_mib: int,
                 kinds: Sequence[str] = FAULT_KINDS) -> None:
        self.urls = urls
        self.server_pid = server_pid
        self.token = token
        self.models = list(models)
        self.clock = clock
        self.hold_s = hold_s
        self.call_timeout_s = call_timeout_s
        self.nonreader_bytes = nonreader_mib << 20
        self.kinds = list(kinds)
        self.records: list[FaultRecord] = []
        self._held: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._infos: dict[str, Any] = {}
        self._instances = 1

    # -- driving -----------------------------------------------------------------------------

    async def run(self, duration_s: float, interval_s: float) -> None:
        """A fault every ``interval_s`` for ``duration_s``, kinds in turn; then clean up.

        Fault ``k`` is due at ``start + k × interval_s`` (a late wake-up on a busy machine
        does not push the rest back), and the first round always fires in full, so every
        kind runs at least once even when the loop falls behind."""
        start = self.clock()
        end = start + duration_s
        try:
            for k in itertools.count():
                due = start + k * interval_s
                if k >= len(self.kinds) and due + interval_s / 2 >= end:
                    break
                await asyncio.sleep(max(0.0, due - self.clock()))
                kind = self.kinds[k % len(self.kinds)]
                task = asyncio.get_running_loop().create_task(self._one(kind))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            # faults under way finish (each is bounded by call_timeout_s) before the phase ends
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=self.call_timeout_s)
        finally:
            await self.close()

    async def _one(self, kind: str) -> None:
        rec = FaultRecord(self.clock(), kind)
        self.records.append(rec)
        try:
            rec.result = await asyncio.wait_for(getattr(self, kind)(rec), self.call_timeout_s)
        except TimeoutError:
            rec.result = f"no reaction within {self.call_timeout_s:g} s"
            rec.findings.append(f"{kind}: the server did not complete it within {self.call_timeout_s:g} s")
        except asyncio.CancelledError:
            rec.result = "still running when the phase ended"
            raise
        except Exception as e:  # a fault that fails is a result to report, not a failed run
            rec.result = f"failed: {type(e).__name__}: {e}"
            logger.info("fault %s failed", kind, exc_info=True)
        finally:
            rec.took_s = self.clock() - rec.t

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self._held:
            s.close()
        self._held.clear()

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def findings(self) -> list[str]:
        return [f for r in self.records for f in r.findings]

    # -- helpers -----------------------------------------------------------------------------

    async def _info(self, model: str) -> Any:
        lane = StreamLane("tcp", self.urls["tcp"], Ledger(), None, self.clock, 1, self.call_timeout_s)  # type: ignore[arg-type]
        await lane.connect()
        try:
            return await lane.lookup(model)
        finally:
            await lane.close()

    async def _connect(self, scheme: str) -> socket.socket:
        from splitserve.client.common import Endpoint

        ep = Endpoint.parse(self.urls[scheme])
        if scheme == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            addr: Any = ep.path
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            addr = (ep.host, ep.port)
        s.setblocking(False)
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(s, addr), 10.0)
        return s

    async def _reaction(self, s: socket.socket) -> str:
        """What the server did about a bad frame: an error frame's status, a close, or nothing."""
        loop = asyncio.get_running_loop()
        buf = b""
        try:
            while len(buf) < HEADER_SIZE:
                chunk = await asyncio.wait_for(loop.sock_recv(s, HEADER_SIZE - len(buf)), _REACTION_S)
                if not chunk:
                    return "closed"
                buf += chunk
        except TimeoutError:
            return "silent"
        except OSError as e:
            return f"closed ({e.strerror or e})"
        h = unpack_header(buf)
        return f"error:{status_name(h.status)}" if h.kind == Kind.ERROR else f"kind {h.kind}"

    def _hold(self, s: socket.socket) -> None:
        self._held.append(s)
        asyncio.get_running_loop().call_later(self.hold_s, s.close)

    def _vecadd(self) -> str:
        return "vecadd1k" if "vecadd1k" in self.models else self.models[0]

    # -- the faults --------------------------------------------------------------------------

    async def kill_worker(self, rec: FaultRecord) -> str:
        """SIGKILL one worker of a model (they take turns), found by its pid in LOOKUP."""
        model = self.models[len(self.records) % len(self.models)]
        info = await self._info(model)
        pids = [p for p in info.extra.get("pids", []) if p]
        rec.target = model
        # only the server's own workers: a pid reused by an unrelated process is left alone
        workers = set(node_workers(self.server_pid))  # one look at /proc, not one per pid
        mine = [p for p in pids if p in workers]
        if not mine:
            return f"no running worker (pids {pids})"
        os.kill(mine[0], signal.SIGKILL)
        return f"killed pid {mine[0]}"

    async def stall(self, rec: FaultRecord) -> str:
        """A request header and part of its payload, then silence (slowloris), held open."""
        n = sum(1 for r in self.records if r.kind == "stall")
        scheme = "tcp" if n % 2 else "unix"
        model = self.models[(n // 2) % len(self.models)]
        cls = RequestClass.RT if (n // 2 // len(self.models)) % 2 else RequestClass.BE
        info = await self._info(model)
        size = sum(t.nbytes for t in info.inputs)
        s = await self._connect(scheme)
        await asyncio.get_running_loop().sock_sendall(
            s, _frame(func_id=info.func_id, payload_len=size, cls=int(cls)) + bytes(size // 2))
        self._hold(s)
        rec.target = f"{model}/{cls.name} over {scheme}"
        return f"holding {size // 2} of {size} B for {self.hold_s:g} s"

    async def nonreader(self, rec: FaultRecord) -> str:
        """Pipelines requests on a connection it never reads, until the server stops taking them."""
        model = self._vecadd()
        info = await self._info(model)
        size = sum(t.nbytes for t in info.inputs)
        s = await self._connect("tcp")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        loop = asyncio.get_running_loop()
        frames = b"".join(_frame(func_id=info.func_id, payload_len=size, req_id=i) + bytes(size)
                          for i in range(1, 65))
        sent = 0
        try:
            while sent < self.nonreader_bytes:
                await asyncio.wait_for(loop.sock_sendall(s, frames), _REACTION_S)
                sent += len(frames)
        except TimeoutError:
            pass  # the server stopped reading: backpressure, as it should
        except OSError as e:
            self._hold(s)
            rec.target = model
            return f"closed by the server after {sent >> 10} KiB ({e.strerror or e})"
        self._hold(s)
        rec.target = model
        return f"{sent // (len(frames) // 64)} requests ({sent >> 20} MiB) sent, never read"

    async def malformed_stream(self, rec: FaultRecord) -> str:
        """Bad frames, each on its own connection: each must get an error frame or a close."""
        info = await self._info(self._vecadd())
        size = sum(t.nbytes for t in info.inputs)
        cases = {
            "bad magic": _frame(magic=b"XXXX"),
            "bad version": _frame(version=9),
            "unknown kind": _frame(kind=42),
            "unknown func id": _frame(func_id=65000, payload_len=size) + bytes(size),
            "wrong size": _frame(func_id=info.func_id, payload_len=size - 4) + bytes(size - 4),
            "over the limit": _frame(func_id=info.func_id, payload_len=MAX_PAYLOAD + 1),
            "bad class": _frame(func_id=info.func_id, payload_len=size, cls=77) + bytes(size),
        }
        reactions = []
        loop = asyncio.get_running_loop()
        for name, frame in cases.items():
            s = await self._connect("tcp")
            try:
                await loop.sock_sendall(s, frame)
                reaction = await self._reaction(s)
            except OSError as e:
                reaction = f"closed ({e.strerror or e})"
            finally:
                s.close()
            if reaction == "silent" or reaction.startswith("kind"):
                rec.findings.append(f"malformed stream frame ({name}): {reaction}")
            reactions.append(f"{name}: {reaction}")
        rec.target = "tcp"
        return "; ".join(reactions)

    async def malformed_udp(self, rec: FaultRecord) -> str:
        """Truncated and overlapping segments, a missing segment, an unknown func id."""
        from splitserve.client.common import Endpoint

        info = await self._info(self._vecadd())
        size = sum(t.nbytes for t in info.inputs)
        ep = Endpoint.parse(self.urls["udp"])
        loop = asyncio.get_running_loop()
        half = size // 2
        seg = {"flags": int(Flags.SEGMENTED), "seg_count": 2, "total_len": size}
        cases: dict[str, tuple[list[bytes], bool]] = {  # datagrams, and whether silence is right
            "truncated": ([_frame(func_id=info.func_id, payload_len=size, total_len=size) + bytes(100)], False),
            "overlapping segments": ([
                _frame(func_id=info.func_id, payload_len=half, payload_offset=0, seq_num=0, **seg) + bytes(half),
                _frame(func_id=info.func_id, payload_len=half, payload_offset=0, seq_num=1, **seg) + bytes(half)],
                False),
            "missing segment": ([_frame(func_id=info.func_id, payload_len=half, seq_num=0, **seg) + bytes(half)],
                                True),
            "unknown func id": ([_frame(func_id=65000, payload_len=size, total_len=size) + bytes(size)], False),
            "bad magic": ([_frame(magic=b"XXXX")], True),  # nothing to answer to
        }
        reactions = []
        for name, (datagrams, silence_ok) in cases.items():
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setblocking(False)
            try:
                s.connect((ep.host, ep.port))
                for d in datagrams:
                    s.send(d)
                try:
                    data = await asyncio.wait_for(loop.sock_recv(s, 65536), 1.0 if silence_ok else _REACTION_S)
                    h = unpack_header(data)
                    reaction = f"error:{status_name(h.status)}" if h.kind == Kind.ERROR else f"kind {h.kind}"
                except TimeoutError:
                    reaction = "silent"
            finally:
                s.close()
            if reaction.startswith("kind") or (reaction == "silent" and not silence_ok):
                rec.findings.append(f"malformed UDP request ({name}): {reaction}"
                                    + (" (accepted and answered)" if reaction == f"kind {Kind.RESPONSE}" else ""))
            reactions.append(f"{name}: {reaction}")
        rec.target = "udp"
        return "; ".join(reactions)

    async def _manage(self, call: Callable[[Any], Any]) -> Any:
        from splitserve.client.http import AsyncHttpClient

        async with AsyncHttpClient(self.urls["http"], timeout=self.call_timeout_s, token=self.token) as c:
            return await call(c)

    async def resize(self, rec: FaultRecord) -> str:
        """Scale a model between one and two instances (it alternates)."""
        model = self._vecadd()
        self._instances = 2 if self._instances == 1 else 1
        rec.target = f"{model} -> {self._instances}"
        await self._manage(lambda c: c.scale(model, self._instances))
        return f"{self._instances} instance(s)"

    async def reconfigure(self, rec: FaultRecord) -> str:
        """Swap a model's batching policy in place (work-conserving and timeout take turns)."""
        model = self.models[-1]
        n = sum(1 for r in self.records if r.kind == "reconfigure")
        batching = ({"policy": "timeout", "max_delay_ms": 2.0, "preferred_batch": 4} if n % 2
                    else {"policy": "work_conserving"})
        rec.target = f"{model}: {batching['policy']}"

        async def configure(c: Any) -> Any:
            r = await c.http.post(f"/v2/repository/models/{model}/config", json={"batching": batching},
                                  headers={"authorization": f"Bearer {self.token}"})
            return r.status_code

        status = await self._manage(configure)
        if status >= 500:
            rec.findings.append(f"reconfigure of {model} answered HTTP {status}")
        return f"HTTP {status}"

    async def unload_load(self, rec: FaultRecord) -> str:
        """Unload a model under load, then load it again."""
        model = self.models[-1]
        rec.target = model
        await self._manage(lambda c: c.unload(model))
        await self._manage(lambda c: c.load(model))
        return "unloaded and loaded"


__all__ = ["FAULT_KINDS", "FaultInjector", "FaultRecord", "rss_kib"]
