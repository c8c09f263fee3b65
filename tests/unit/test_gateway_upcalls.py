"""Registrations made at the cluster gateway: the upcall codec between the data plane and the
Gateway actor, the actor's handler over a fake controller, and the controller's unregister
with fake node servers. No Ray cluster, no sockets, no processes."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pytest
import ray

from splitserve.cluster.actors.ingress import ControllerRegistry
from splitserve.cluster.gateway import upcall
from splitserve.cluster.gateway.modelspec import ModelSpec
from splitserve.errors import InternalError, InvalidInput, PayloadTooLarge, Status, UnknownModel

TOML = 'name = "mine"\n[artifact]\nkind = "safetensors"\nfile = "w.safetensors"\n'
MESSAGES = [
    ModelSpec("mine", TOML, b"\x00weights\xff" * 3, "cat\ndog\n"),
    ModelSpec("zoo", 'name = "zoo"\n'),
    upcall.UnregisterCall("mine"),
    upcall.Registered("mine", 7),
    upcall.Unregistered("mine"),
    upcall.Failed(int(Status.INVALID_INPUT), "model 'mine' is already registered"),
]


def _recv(data: bytes) -> Any:
    buf = io.BytesIO(data)

    def recv_exact(n: int) -> bytes:
        got = buf.read(n)
        if len(got) < n:
            raise EOFError
        return got

    return recv_exact


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_upcall_message_comes_back_as_it_was_sent_with_its_id(msg: Any) -> None:
    frame = upcall.encode(41, msg)
    assert upcall.read_frame(_recv(frame), 1 << 20) == (41, msg)

    async def from_stream() -> tuple[int, Any]:
        reader = asyncio.StreamReader()
        reader.feed_data(frame)
        reader.feed_eof()
        return await upcall.read_frame_async(reader, 1 << 20)

    assert asyncio.run(from_stream()) == (41, msg)


def test_an_upcall_over_its_limits_or_malformed_is_refused_before_its_files_are_read() -> None:
    big = upcall.encode(1, ModelSpec("mine", TOML, bytes(1000)))
    with pytest.raises(PayloadTooLarge, match="1000|files"):
        upcall.read_frame(_recv(big), 999)
    huge_head = (upcall.HEAD_LIMIT + 1).to_bytes(4, "big")
    with pytest.raises(PayloadTooLarge, match="head"):
        upcall.read_frame(_recv(huge_head), 1 << 20)
    garbage = b"{not json"
    with pytest.raises(InternalError, match="head"):
        upcall.read_frame(_recv(len(garbage).to_bytes(4, "big") + garbage), 1 << 20)
    with pytest.raises(EOFError):  # a frame cut short: the channel is gone, not a call
        upcall.read_frame(_recv(big[:-10]), 1 << 20)


class FakeRegistry:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls: list[Any] = []

    def register(self, call: ModelSpec) -> int:
        self.calls.append(call)
        if self.error is not None:
            raise self.error
        return 12

    def unregister(self, name: str) -> None:
        self.calls.append(name)
        if self.error is not None:
            raise self.error


def test_the_actors_handler_answers_every_call_with_the_controllers_result_or_its_error() -> None:
    ok = FakeRegistry()
    assert upcall.handle(ok, MESSAGES[0]) == upcall.Registered("mine", 12)
    assert upcall.handle(ok, upcall.UnregisterCall("mine")) == upcall.Unregistered("mine")
    assert ok.calls == [MESSAGES[0], "mine"]
    refused = upcall.handle(FakeRegistry(InvalidInput("model 'mine' is already registered")), MESSAGES[0])
    assert refused == upcall.Failed(int(Status.INVALID_INPUT), "model 'mine' is already registered")
    assert isinstance(refused.error(), InvalidInput)
    bug = upcall.handle(FakeRegistry(RuntimeError("boom")), upcall.UnregisterCall("mine"))
    assert bug.status == int(Status.INTERNAL) and "boom" in bug.message
    assert upcall.handle(ok, upcall.Registered("x", 1)).status == int(Status.INVALID_INPUT)


class _Remote:
    """A controller method whose ``remote`` returns what it was called with (the fake ``get`` reads it)."""

    def __init__(self, name: str) -> None:
        self.remote = lambda *args: (name, args)


class FakeController:
    def __init__(self) -> None:
        self.register = _Remote("register")
        self.unregister = _Remote("unregister")


def test_the_controller_registry_sends_a_model_spec_and_gives_back_the_controllers_own_error() -> None:
    seen: list[Any] = []

    def get(ref: Any, timeout: float) -> Any:
        seen.append((ref, timeout))
        if ref[0] == "unregister":
            raise ray.exceptions.RayTaskError("unregister", "traceback", UnknownModel("no model named 'x'"))
        return 3

    reg = ControllerRegistry(FakeController(), 9.0, get=get)
    assert reg.register(ModelSpec("mine", TOML, b"w", "a\n")) == 3
    assert seen == [(("register", (ModelSpec("mine", TOML, b"w", "a\n"),)), 9.0)]
    with pytest.raises(UnknownModel, match="no model named 'x'"):
        reg.unregister("x")

    def slow(ref: Any, timeout: float) -> Any:
        raise ray.exceptions.GetTimeoutError("late")

    with pytest.raises(InternalError, match="9 s"):
        ControllerRegistry(FakeController(), 9.0, get=slow).register(ModelSpec("mine", TOML))
