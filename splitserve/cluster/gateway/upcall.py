"""The gateway's upcalls: its data plane (``cluster/gateway/dataplane.py``, no Ray) asks the
Gateway actor (``cluster/actors/ingress.py``) to register (the call is the model's ``ModelSpec``)
or unregister a model with the cluster's controller.

They travel on a socketpair the actor makes for each data-plane process it starts (the
process's end passed with ``pass_fds``): one call at a time, each bounded in size (the
upload limit) and in time (``ClusterConfig.registration_timeout_s``). A frame is a 4-byte
big-endian length, a JSON head of at most ``HEAD_LIMIT`` bytes naming the message and the
sizes of its blobs, then the blobs (a model's config, labels and artifact go as bytes, so
JSON escaping cannot grow them past the limit). Every call carries an id and its answer the
same id, so an answer that comes after its caller gave up is told apart and dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from splitserve.cluster.gateway.modelspec import ModelSpec
from splitserve.errors import InternalError, PayloadTooLarge, SplitServeError, Status, error_for_status

log = logging.getLogger(__name__)

TOKEN_ENV = "SPLITSERVE_GATEWAY_TOKEN"  # the cluster's management token, as the actor hands it to the data plane
HEAD_LIMIT = 64 << 10  # a head names a message, a model and blob sizes: far less than this
_LEN = struct.Struct("!I")


@dataclass(frozen=True)
class UnregisterCall:
    """Stop serving ``name`` on every node and forget it."""

    name: str


@dataclass(frozen=True)
class Registered:
    """The answer to a registration (a ``ModelSpec``): the model's cluster func id."""

    name: str
    func_id: int


@dataclass(frozen=True)
class Unregistered:
    """The answer to an ``UnregisterCall``."""

    name: str


@dataclass(frozen=True)
class Failed:
    """A call the controller refused or could not carry out: a ``SplitServeError``'s status and message."""

    status: int
    message: str

    def error(self) -> SplitServeError:
        return error_for_status(self.status, self.message)


Call = ModelSpec | UnregisterCall
Answer = Registered | Unregistered | Failed


def encode(call_id: int, msg: Call | Answer) -> bytes:
    """One frame: ``msg`` under ``call_id``."""
    blobs: list[bytes] = []
    if isinstance(msg, ModelSpec):
        fields = {"name": msg.name}
        parts = {"config_toml": msg.config_toml.encode(), "labels": None if msg.labels is None else msg.labels.encode(),
                 "artifact": msg.artifact}
        sizes = {}
        for key, blob in parts.items():
            if blob is not None:
                sizes[key] = len(blob)
                blobs.append(blob)
        fields["blobs"] = sizes
    elif isinstance(msg, (UnregisterCall, Registered, Unregistered, Failed)):
        fields = {k: getattr(msg, k) for k in msg.__dataclass_fields__}
    else:
        raise TypeError(f"not an upcall message: {msg!r}")
    head = json.dumps({"id": call_id, "kind": type(msg).__name__, **fields}).encode()
    return b"".join([_LEN.pack(len(head)), head, *blobs])


def _blob_sizes(head: dict) -> dict[str, int]:
    sizes = head.get("blobs", {})
    if not isinstance(sizes, dict) or not all(k in ("config_toml", "labels", "artifact") and isinstance(n, int)
                                              and n >= 0 for k, n in sizes.items()):
        raise InternalError(f"bad upcall blobs {sizes!r}")
    return sizes


def _parse_head(raw: bytes) -> dict:
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InternalError(f"bad upcall head: {e}") from None
    if not isinstance(head, dict) or not isinstance(head.get("id"), int) or not isinstance(head.get("kind"), str):
        raise InternalError(f"bad upcall head {head!r}")
    return head


def _message(head: dict, blobs: dict[str, bytes]) -> Call | Answer:
    kind = head.pop("kind")
    head.pop("id")
    head.pop("blobs", None)
    try:
        if kind == "ModelSpec":
            labels = blobs.get("labels")
            return ModelSpec(str(head["name"]), blobs.get("config_toml", b"").decode(), blobs.get("artifact"),
                                None if labels is None else labels.decode())
        types = {t.__name__: t for t in (UnregisterCall, Registered, Unregistered, Failed)}
        return types[kind](**head)
    except (KeyError, TypeError, UnicodeDecodeError) as e:
        raise InternalError(f"bad upcall {kind!r}: {e}") from None


def _check_size(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise PayloadTooLarge(f"an upcall's {what} of {n} bytes exceeds its {limit} byte limit")


def read_frame(recv_exact: Callable[[int], bytes], limit: int) -> tuple[int, Call | Answer]:
    """One frame through ``recv_exact(n)`` (exactly n bytes, or EOFError): its call id and
    message. The head is bounded by ``HEAD_LIMIT``, the blobs together by ``limit``."""
    (n,) = _LEN.unpack(recv_exact(_LEN.size))
    _check_size(n, HEAD_LIMIT, "head")
    head = _parse_head(recv_exact(n))
    sizes = _blob_sizes(head)
    _check_size(sum(sizes.values()), limit, "files")
    call_id = head["id"]
    return call_id, _message(head, {k: recv_exact(size) for k, size in sizes.items()})


async def read_frame_async(reader: asyncio.StreamReader, limit: int) -> tuple[int, Call | Answer]:
    """``read_frame`` from a stream (the data plane's end)."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    _check_size(n, HEAD_LIMIT, "head")
    head = _parse_head(await reader.readexactly(n))
    sizes = _blob_sizes(head)
    _check_size(sum(sizes.values()), limit, "files")
    call_id = head["id"]
    return call_id, _message(head, {k: await reader.readexactly(size) for k, size in sizes.items()})


class ClusterRegistry(Protocol):
    """What the actor's end calls per upcall: the cluster's controller (``ingress.ControllerRegistry``)."""

    def register(self, call: ModelSpec) -> int:
        """Register the model on every node; its cluster func id."""

    def unregister(self, name: str) -> None:
        """Unregister the model on every node."""


def handle(registry: ClusterRegistry, msg: Call | Answer) -> Answer:
    """Carry out one call through ``registry``; every error becomes a ``Failed`` answer."""
    try:
        if isinstance(msg, ModelSpec):
            return Registered(msg.name, registry.register(msg))
        if isinstance(msg, UnregisterCall):
            registry.unregister(msg.name)
            return Unregistered(msg.name)
        return Failed(int(Status.INVALID_INPUT), f"not an upcall: {type(msg).__name__}")
    except SplitServeError as e:
        return Failed(int(e.status), e.message)
    except Exception as e:  # noqa: BLE001 - a bug or a lost controller: the caller still gets an answer
        log.exception("upcall %s failed", type(msg).__name__)
        return Failed(int(Status.INTERNAL), f"the cluster could not carry out the call: {type(e).__name__}: {e}")


def serve(sock: socket.socket, registry: ClusterRegistry, limit: int) -> None:
    """Answer the upcalls on ``sock`` one at a time until the data plane closes its end (the
    actor's thread). A frame that breaks the codec closes the channel: the stream cannot be
    trusted after it, and the data plane answers its callers that the cluster did not reply."""

    def recv_exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    with sock:
        while True:
            try:
                call_id, msg = read_frame(recv_exact, limit)
            except (EOFError, OSError):
                return
            except SplitServeError as e:
                log.error("gateway upcalls: %s; closing the channel", e.message)
                return
            try:
                sock.sendall(encode(call_id, handle(registry, msg)))
            except OSError:
                return


class UpcallClient:
    """The data plane's end: one call at a time, each bounded by ``timeout_s`` (waiting for
    the call before it included). One reader task takes every answer off the channel, so a
    caller that gives up never leaves half a frame behind."""

    def __init__(self, sock: socket.socket, limit: int, timeout_s: float) -> None:
        self.sock = sock
        self.limit = limit
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._ids = 0
        self._waiting: dict[int, asyncio.Future[Answer]] = {}  # at most one: calls go one at a time
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task | None = None
        self._lost: str | None = None  # why the channel is gone

    async def call(self, msg: Call) -> Answer:
        """Send ``msg`` and return its answer (a ``Failed`` one included); InternalError when
        the channel is gone or the answer does not come within ``timeout_s``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._lock:
                    writer = await self._open()
                    self._ids += 1
                    fut = self._waiting[self._ids] = asyncio.get_running_loop().create_future()
                    try:
                        writer.write(encode(self._ids, msg))
                        await writer.drain()
                        return await fut
                    finally:
                        self._waiting.pop(self._ids, None)
        except TimeoutError:
            raise InternalError(f"the cluster did not answer within {self.timeout_s:g} s "
                                "(SPLITSERVE_CLUSTER_REGISTRATION_TIMEOUT_S); see the controller's log") from None
        except ConnectionError as e:
            self._lost = self._lost or str(e)
            raise InternalError(f"the gateway lost its channel to the cluster: {self._lost}") from None

    async def _open(self) -> asyncio.StreamWriter:
        if self._lost is not None:
            raise ConnectionError(self._lost)
        if self._writer is None:
            reader, self._writer = await asyncio.open_connection(sock=self.sock, limit=HEAD_LIMIT)
            self._reader = asyncio.get_running_loop().create_task(self._answers(reader), name="gateway-upcalls")
        return self._writer

    async def _answers(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, answer = await read_frame_async(reader, self.limit)
                fut = self._waiting.get(call_id)
                if fut is None or fut.done():
                    log.info("gateway upcalls: dropped a late answer to call %d", call_id)
                elif isinstance(answer, (Registered, Unregistered, Failed)):
                    fut.set_result(answer)
                else:
                    fut.set_exception(InternalError(f"the cluster answered with a call: {answer!r}"))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._lost = f"the Gateway actor closed it ({e})"
        except SplitServeError as e:
            self._lost = e.message
        log.warning("gateway upcalls: channel lost: %s", self._lost)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError(self._lost))

    def close(self) -> None:
        """Stop reading answers and close the channel."""
        if self._reader is not None:
            self._reader.cancel()
        if self._writer is not None:
            self._writer.close()
        else:
            self.sock.close()
