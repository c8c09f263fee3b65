"""A client's side of a HANDOFF (``protocol/handoff.py``): on a fresh connection to the
front end, ask for it to be handed over to a worker, and read the worker's
acknowledgement, or the error the front end or the worker answered instead. The sync
client does it on a blocking socket, the asyncio one on a non-blocking socket through
the loop, before a transport serves it."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from splitserve.errors import BadFrame, error_for_status
from splitserve.protocol.handoff import handoff_frame
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header

# An answer to a HANDOFF carries no payload, or an error's message: anything longer is not one
_ANSWER_MAX = 64 * 1024


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking socket (its SO_RCVTIMEO bounds the wait)."""
    try:
        data = sock.recv(n, socket.MSG_WAITALL) if n else b""
    except BlockingIOError:  # SO_RCVTIMEO ran out with nothing read
        raise TimeoutError("timed out") from None
    if len(data) < n:  # closed, or quiet past SO_RCVTIMEO mid-frame
        raise ConnectionError(f"the server sent {len(data)} of a frame's {n} bytes, then closed or went quiet")
    return data


def _message_bytes(h: Header) -> int:
    """The bytes of message that follow the answer ``h`` to a HANDOFF: an error's (0 for
    anything else, which ``check_answer`` refuses)."""
    return h.payload_len if h.kind == Kind.ERROR and h.payload_len <= _ANSWER_MAX else 0


def check_answer(h: Header, message: bytes, req_id: int) -> None:
    """Check the answer ``h`` to HANDOFF ``req_id``: the worker's acknowledgement, or the
    error the front end or the worker answered instead (raised, with its ``message``)."""
    if h.kind == Kind.ERROR and h.payload_len <= _ANSWER_MAX:
        raise error_for_status(h.status, message.decode(errors="replace"))
    if h.kind != Kind.HANDOFF or h.req_id != req_id or h.payload_len:
        raise BadFrame(f"a HANDOFF is answered by the worker's empty HANDOFF {req_id} or an ERROR, not "
                       f"{Kind(h.kind).name} {h.req_id} with {h.payload_len} bytes")


def hand_over(sock: socket.socket, req_id: int, model: str, url: str) -> None:
    """Have the front end at the other end of ``sock`` (a fresh, blocking connection) hand it
    to ``model``'s worker whose direct endpoint is ``url``: returns once the worker
    acknowledged, so the next frame sent is the worker's; raises what the front end or the
    worker answered instead, ConnectionError where the connection closed first."""
    sock.sendall(handoff_frame(req_id, model, url))
    h = unpack_header(_recv_exact(sock, HEADER_SIZE))
    check_answer(h, _recv_exact(sock, _message_bytes(h)), req_id)


async def hand_over_async(sock: socket.socket, where: Any, req_id: int, model: str, url: str) -> None:
    """``hand_over`` for the asyncio client: connect ``sock`` (a fresh socket) to the front
    end at ``where`` through the running loop, and have it handed over to the worker."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    await loop.sock_connect(sock, where)
    await loop.sock_sendall(sock, handoff_frame(req_id, model, url))

    async def read(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = await loop.sock_recv(sock, n - len(data))
            if not chunk:
                raise ConnectionError("the server closed the connection before its answer to a HANDOFF was whole")
            data += chunk
        return bytes(data)

    h = unpack_header(await read(HEADER_SIZE))
    check_answer(h, await read(_message_bytes(h)), req_id)
