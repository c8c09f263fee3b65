"""One error root, ``SplitServeError``; each subclass maps one-to-one to a wire status.

The fast path carries ``status`` (a u16 in the control header); HTTP and gRPC map the
same classes to their own codes through ``http_status`` and ``grpc_code``.
"""

from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    """Status codes of the fast-path control header (docs/protocol.md)."""

    OK = 0
    BAD_FRAME = 1  # magic, version, kind or lengths wrong
    UNKNOWN_MODEL = 2
    BAD_SIZE = 3  # payload length does not match the model's inputs
    QUEUE_FULL = 4
    DEADLINE_MISSED = 5
    WORKER_FAILED = 6
    SHUTTING_DOWN = 7
    DUPLICATE_REQUEST = 8  # req_id already in flight on this connection
    BAD_SEGMENT = 9  # seq_num / seg_count out of range
    INVALID_INPUT = 10  # anything else the caller got wrong
    MODEL_NOT_READY = 11
    UNAUTHORIZED = 12
    REFUSED = 13  # refused by policy (e.g. best-effort in rt-only mode)
    PAYLOAD_TOO_LARGE = 14  # a body over its limit (HTTP and gRPC; the fast path says BAD_SIZE)
    INSUFFICIENT_STORAGE = 15  # the server's disk is full (ENOSPC, EDQUOT)
    NOT_FOUND = 16  # a named thing other than a model is not there (a shared-memory region or object)
    INTERNAL = 99


class SplitServeError(Exception):
    """Root of every error splitserve raises on purpose."""

    status: Status = Status.INTERNAL
    http_status: int = 500
    grpc_code: str = "INTERNAL"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__name__)
        self.message = message or self.__class__.__name__


class BadFrame(SplitServeError):
    status, http_status, grpc_code = Status.BAD_FRAME, 400, "INVALID_ARGUMENT"


class UnknownModel(SplitServeError):
    status, http_status, grpc_code = Status.UNKNOWN_MODEL, 404, "NOT_FOUND"


class BadSize(SplitServeError):
    status, http_status, grpc_code = Status.BAD_SIZE, 400, "INVALID_ARGUMENT"


class QueueFull(SplitServeError):
    status, http_status, grpc_code = Status.QUEUE_FULL, 503, "UNAVAILABLE"


class DeadlineMissed(SplitServeError):
    status, http_status, grpc_code = Status.DEADLINE_MISSED, 504, "DEADLINE_EXCEEDED"


class WorkerFailed(SplitServeError):
    status, http_status, grpc_code = Status.WORKER_FAILED, 500, "INTERNAL"


class ShuttingDown(SplitServeError):
    status, http_status, grpc_code = Status.SHUTTING_DOWN, 503, "UNAVAILABLE"


class DuplicateRequest(SplitServeError):
    status, http_status, grpc_code = Status.DUPLICATE_REQUEST, 409, "ALREADY_EXISTS"


class BadSegment(SplitServeError):
    status, http_status, grpc_code = Status.BAD_SEGMENT, 400, "INVALID_ARGUMENT"


class InvalidInput(SplitServeError):
    status, http_status, grpc_code = Status.INVALID_INPUT, 400, "INVALID_ARGUMENT"


class ResourcesUnavailable(InvalidInput):
    """The node cannot give what a placement asks for (CPUs held by other owners, or a change
    that cannot be made without a pause in service), or the cluster's provider gave no node
    in the market asked for in time; the message names what is missing. A kind of
    InvalidInput: the caller must ask for something else (procurement: the other market)."""


class ModelNotReady(SplitServeError):
    status, http_status, grpc_code = Status.MODEL_NOT_READY, 503, "UNAVAILABLE"


class Unauthorized(SplitServeError):
    status, http_status, grpc_code = Status.UNAUTHORIZED, 401, "UNAUTHENTICATED"


class Refused(SplitServeError):
    status, http_status, grpc_code = Status.REFUSED, 429, "RESOURCE_EXHAUSTED"


class PayloadTooLarge(SplitServeError):
    status, http_status, grpc_code = Status.PAYLOAD_TOO_LARGE, 413, "RESOURCE_EXHAUSTED"


class InsufficientStorage(SplitServeError):
    status, http_status, grpc_code = Status.INSUFFICIENT_STORAGE, 507, "RESOURCE_EXHAUSTED"


class NotFound(SplitServeError):
    """A management call names something that is not there: a shared-memory region or
    object, or an extension this server lacks (CUDA shared memory). An inference call that
    names a missing region is InvalidInput instead: its request is what is wrong."""

    status, http_status, grpc_code = Status.NOT_FOUND, 404, "NOT_FOUND"


class InternalError(SplitServeError):
    """The server failed itself (e.g. the watchdog answering a call nothing else answered)."""

    status, http_status, grpc_code = Status.INTERNAL, 500, "INTERNAL"


_BY_STATUS: dict[int, type[SplitServeError]] = {
    cls.status: cls
    for cls in (
        BadFrame, UnknownModel, BadSize, QueueFull, DeadlineMissed, WorkerFailed, ShuttingDown,
        DuplicateRequest, BadSegment, InvalidInput, ModelNotReady, Unauthorized, Refused,
        PayloadTooLarge, InsufficientStorage, NotFound, InternalError,
    )
}


def error_for_status(status: int, message: str) -> SplitServeError:
    """Rebuild the typed error a peer reported with ``status`` (client side)."""
    return _BY_STATUS.get(status, SplitServeError)(message)
