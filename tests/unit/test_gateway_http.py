"""An HTTP call at the cluster gateway is held by the same ledger as a fast-path frame: sent
to a node, re-sent when that node is lost, answered once, a late duplicate dropped. No
sockets: the gateway's node links are fakes, answers are fed to its link reader."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from splitserve.cluster.gateway.core import GatewayCore, NodeRoute, Routes, _Link
from splitserve.cluster.gateway.dataplane import GatewayServing
from splitserve.cluster.policy.dispatch import NodeState
from splitserve.cluster.pools import Market
from splitserve.cluster.config import ClusterConfig
from splitserve.protocol.header import HEADER_SIZE, Header, Kind, unpack_header

NODE_FID = 3  # lenet's id on every fake node
CLUSTER_FID = 7
LOOKUP = json.dumps({"name": "lenet", "func_id": NODE_FID, "version": 1, "max_batch_size": 8,
                     "inputs": [{"name": "image", "datatype": "UINT8", "shape": [1, 28, 28]}],
                     "outputs": [{"name": "logits", "datatype": "FP32", "shape": [10]}]}).encode()


class FakeWriter:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def writelines(self, parts: list[bytes]) -> None:
        self.frames.append(b"".join(parts))

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def close(self) -> None:
        pass


class FakeLinks(GatewayCore):
    """The gateway with its one I/O edge replaced: a node's link is a fake writer that knows
    lenet at once."""

    async def _keep_link(self, node: str) -> None:
        self._links[node] = _Link(node, FakeWriter(), {"lenet": NODE_FID}, {"lenet": LOOKUP})  # type: ignore[arg-type]
        self.health.add(node, self.clock())
        await asyncio.Event().wait()


def _routes(version: int, **states: NodeState) -> Routes:
    markets = {"od": Market.ON_DEMAND, "spot": Market.SPOT}
    nodes = tuple(NodeRoute(n, "127.0.0.1", 1, markets[n], s, frozenset({"lenet"})) for n, s in states.items())
    return Routes(version, nodes, (("lenet", CLUSTER_FID),))


async def _answer(core: GatewayCore, link: _Link, req_id: int, logits: np.ndarray) -> None:
    reader = asyncio.StreamReader()
    body = logits.tobytes()
    reader.feed_data(Header(Kind.RESPONSE, req_id=req_id, func_id=NODE_FID, payload_len=len(body)).pack() + body)
    reader.feed_eof()
    await core._read_link(link, reader)


def test_an_http_call_is_resent_when_its_node_is_lost_and_answered_once():
    async def scenario() -> None:
        now = [0.0]
        core = FakeLinks(ClusterConfig(), clock=lambda: now[0])
        core.update(_routes(1, od=NodeState.ACTIVE, spot=NodeState.ACTIVE))
        await asyncio.sleep(0)
        first, other = core._links["od"], core._links["spot"]  # a real-time call goes on-demand first
        serving = GatewayServing(core)
        call = asyncio.get_running_loop().create_task(
            serving.infer("lenet", [np.zeros((1, 1, 28, 28), np.uint8)], "rt"))
        await asyncio.sleep(0)
        (frame,) = first.writer.frames  # type: ignore[attr-defined]
        sent = unpack_header(frame[:HEADER_SIZE])
        assert sent.func_id == NODE_FID and len(frame) == HEADER_SIZE + 784

        core.update(_routes(2, od=NodeState.DEAD, spot=NodeState.ACTIVE))  # the controller: node lost
        (again,) = other.writer.frames  # type: ignore[attr-defined]
        assert unpack_header(again[:HEADER_SIZE]).req_id == sent.req_id and again[HEADER_SIZE:] == frame[HEADER_SIZE:]
        assert not call.done()

        logits = np.arange(10, dtype=np.float32)
        await _answer(core, other, sent.req_id, logits)
        await _answer(core, first, sent.req_id, logits + 1)  # the lost node's late answer
        out = await call
        np.testing.assert_array_equal(out.outputs[0], logits.reshape(1, 10))
        assert core.ledger.resent == 1 and core.ledger.dropped == 1 and core.ledger.delivered == 1
        assert len(core.ledger) == 0 and core.stats()["held_bytes"] == 0
        await core.close()

    asyncio.run(scenario())
