"""gRPC ``ModelStreamInfer`` driven directly with fakes of the ``InferenceAPI`` and the
``ModelCatalog``: no sockets, no processes; the calls' answers are futures the test resolves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
import numpy as np

from splitserve.config import ServerConfig
from splitserve.errors import UnknownModel
from splitserve.modelconfig import ArtifactConfig, ModelConfig
from splitserve.protocol import grpc_api as pb
from splitserve.protocol.v2 import tensor_to_bytes
from splitserve.server.frontends import CodecPool
from splitserve.server.grpc_server import InferenceServicer
from splitserve.server.ports import InferOutcome
from splitserve.server.shm import SystemSharedMemory
from splitserve.types import TensorSpec

MODEL = ModelConfig("m", (TensorSpec("x", "FP32", (2,)),), (TensorSpec("y", "FP32", (2,)),),
                    ArtifactConfig(arch="any"))


class FakeCatalog:
    def version(self, name: str, version: str | None = None) -> str:
        if name != MODEL.name:
            raise UnknownModel(f"unknown model {name!r}")
        return "1"

    def model_config(self, name: str) -> ModelConfig:
        return MODEL


class FakeAPI:
    """``infer`` waits for the test to answer each call; the calls started are in ``calls``."""

    def __init__(self) -> None:
        self.calls: list[tuple[np.ndarray, asyncio.Future[InferOutcome]]] = []

    async def infer(self, name: str, inputs: list[np.ndarray], cls: object = None,
                    deadline_s: float | None = None, slo_s: float | None = None) -> InferOutcome:
        fut: asyncio.Future[InferOutcome] = asyncio.get_running_loop().create_future()
        self.calls.append((inputs[0], fut))
        return await fut

    def answer(self, i: int) -> None:
        x, fut = self.calls[i]
        fut.set_result(InferOutcome([x * 2], 0, 0, 0))


def request(call_id: str, model: str = "m", value: float = 1.0) -> bytes:
    req = pb.ModelInferRequest(model_name=model, id=call_id)
    req.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    req.raw_input_contents.append(bytes(tensor_to_bytes(np.full((1, 2), value, np.float32))))
    return req.SerializeToString()


async def settle() -> None:
    """Let every ready task run until none is left to run (no timing involved)."""
    for _ in range(50):
        await asyncio.sleep(0)


def servicer(api: FakeAPI, limit: int) -> InferenceServicer:
    codec = CodecPool(threads=1, max_pending=4, inline_bytes=1 << 20)  # every body decoded inline
    config = ServerConfig.of(grpc_stream_max_in_flight=limit)
    return InferenceServicer(api, FakeCatalog(), codec, config,  # type: ignore[arg-type]
                             SystemSharedMemory(max_regions=1, max_bytes=1))


def test_stream_reads_at_most_the_limit_ahead_answers_by_id_and_keeps_going_after_an_error() -> None:
    async def scenario() -> None:
        api = FakeAPI()
        pulled: list[str] = []
        messages = [("a", "m"), ("bad", "nope"), ("b", "m"), ("c", "m"), ("d", "m"), ("e", "m")]

        async def requests() -> AsyncIterator[bytes]:
            for call_id, model in messages:
                pulled.append(call_id)
                yield request(call_id, model)

        stream = servicer(api, limit=3).ModelStreamInfer(requests(), None)
        first = asyncio.ensure_future(stream.__anext__())
        await settle()
        # a, bad (answered at once, but its answer not yet sent) and b hold the 3 places;
        # c is read and waits for a place: reading stops there
        assert pulled == ["a", "bad", "b", "c"] and len(api.calls) == 2
        error = pb.ModelStreamInferResponse.FromString(await first)
        assert error.infer_response.id == "bad" and "unknown model 'nope'" in error.error_message
        nxt = asyncio.ensure_future(stream.__anext__())  # grpc asks for more once the answer is sent
        await settle()
        assert len(api.calls) == 3 and pulled == ["a", "bad", "b", "c", "d"]  # the sent answer freed c's place
        api.answer(1)  # b finishes before a: answered first, matched by its id
        b = pb.ModelStreamInferResponse.FromString(await nxt)
        assert b.error_message == "" and b.infer_response.id == "b" and b.infer_response.model_name == "m"
        assert np.frombuffer(b.infer_response.raw_output_contents[0], np.float32).tolist() == [2.0, 2.0]
        for i in (0, 2):
            api.answer(i)
        ids = [pb.ModelStreamInferResponse.FromString(await stream.__anext__()).infer_response.id for _ in (0, 1)]
        assert sorted(ids) == ["a", "c"]
        await settle()
        for i in (3, 4):
            api.answer(i)
        rest = [pb.ModelStreamInferResponse.FromString(m).infer_response.id async for m in stream]
        assert sorted(rest) == ["d", "e"]  # then the stream ends: every call had exactly one answer

    asyncio.run(scenario())


def test_a_cancelled_stream_stops_reading_and_its_calls_in_flight_still_finish() -> None:
    async def scenario() -> None:
        api = FakeAPI()

        async def requests() -> AsyncIterator[bytes]:
            for i in range(10):
                yield request(f"r{i}")

        stream = servicer(api, limit=2).ModelStreamInfer(requests(), None)
        pending = asyncio.ensure_future(stream.__anext__())
        await settle()
        assert len(api.calls) == 2
        pending.cancel()  # the client went away: grpc cancels the handler
        await settle()
        await stream.aclose()
        api.answer(0)
        api.answer(1)
        await settle()
        assert len(api.calls) == 2  # nothing more was read
        assert all(fut.done() and not fut.cancelled() for _, fut in api.calls)

    asyncio.run(scenario())
