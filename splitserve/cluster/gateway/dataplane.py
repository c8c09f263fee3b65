"""The gateway's data-plane process: its composition root (``python -m splitserve.cluster.gateway.dataplane``).

It builds one ``GatewayCore`` (the fast path over TCP, the ledger, dispatch and health
checks) and, unless their ports are off, HTTP and gRPC front ends over it: the node's own
Open Inference Protocol v2 inference half (``server.http.inference_app``: health, model
readiness and metadata, infer with JSON tensors and the binary tensor data extension, and
``/metrics``, the gateway's series and every node's merged, ``cluster/gateway/metrics.py``;
``server.grpc_server.InferenceServicer``: the same calls, ``ModelInfer`` and
``ModelStreamInfer``), served through ``GatewayServing``, which turns each call into a
fast-path request held by the same ledger as a client's frame. So an HTTP or gRPC call is
dispatched, re-sent on a node's loss and answered once exactly as a fast-path call is. Ray
is never imported here.

Its HTTP also serves the repository routes a node serves (``server.http.repository_routes``:
register, unregister, the index), and its gRPC the repository calls that map onto them
(``server.grpc_server.RepositoryServicer``: ``RepositoryIndex``, ``RepositoryModelLoad`` with
a config registers), through ``GatewayRegistrar``: the cluster's management token
(given in the environment, ``upcall.TOKEN_ENV``, never on the command line), and each
registration forwarded to the controller as an upcall to the Gateway actor
(``cluster/gateway/upcall.py``, on a socketpair the actor passes in ``--upcall-fd``).

Routes from the controller arrive through the Gateway actor as JSON lines on stdin (the line
``stats`` asks for the core's counters); the process prints what it bound as one JSON line on
stdout once it listens, and stops at stdin's EOF (its actor is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitserve.client.common import ModelInfo, decode_outputs
from splitserve.cluster.gateway.core import GatewayCore, Routes
from splitserve.cluster.gateway.metrics import GatewayMetrics
from splitserve.cluster.gateway.modelspec import ModelSpec
from splitserve.cluster.gateway.upcall import TOKEN_ENV, Failed, UnregisterCall, UpcallClient
from splitserve.cluster.policy.dispatch import NodeState
from splitserve.cluster.config import ClusterConfig
from splitserve.config import ServerConfig
from splitserve.errors import InternalError, InvalidInput, ModelNotReady, SplitServeError, Unauthorized, UnknownModel
from splitserve.modelconfig import ModelConfig
from splitserve.protocol import v2
from splitserve.protocol.header import Header, Kind, RequestClass
from splitserve.server.frontends import CodecPool
from splitserve.server.grpc_server import GrpcFrontEnd, InferenceServicer, RepositoryServicer
from splitserve.server.http import HttpFrontEnd, inference_app
from splitserve.server.management import check_bearer
from splitserve.server.ports import FrontEnd, InferOutcome, ModelRegistrar
from splitserve.server.shm import SystemSharedMemory
from splitserve.types import batch_of

log = logging.getLogger(__name__)


class _FutureReply:
    """An HTTP call's answer: it resolves the future its handler awaits."""

    def __init__(self, fut: "asyncio.Future[tuple[Header, bytes]]") -> None:
        self.fut = fut

    def result(self, h: Header, payload: bytes) -> None:
        if not self.fut.done():  # the handler was cancelled (its client left)
            self.fut.set_result((h, payload))

    def error(self, e: SplitServeError) -> None:
        if not self.fut.done():
            self.fut.set_exception(e)


class GatewayServing:
    """The gateway as the inference routes see it (``ports.InferenceAPI`` and
    ``ports.ModelCatalog``): models and their tensors from the nodes' lookup replies, each
    call a fast-path request through ``GatewayCore.submit``."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def infer(self, name: str, inputs: Sequence[np.ndarray], cls: str | int | None = None,
                    deadline_s: float | None = None, slo_s: float | None = None) -> InferOutcome:
        info = self.core.model_info(name)
        count = batch_of(name, info.inputs, inputs)
        payload = b"".join(memoryview(np.ascontiguousarray(a)).cast("B") for a in inputs)  # one copy
        h = Header(Kind.REQUEST, func_id=info.func_id, cls=int(RequestClass.parse(cls)),
                   deadline_us=int(deadline_s * 1e6) if deadline_s else 0,
                   slo_us=int(slo_s * 1e6) if slo_s else 0, payload_len=len(payload))
        fut: asyncio.Future[tuple[Header, bytes]] = asyncio.get_running_loop().create_future()
        self.core.submit(name, h, payload, _FutureReply(fut))
        answer, body = await fut
        outputs = decode_outputs(info, body, count, batched=True)
        return InferOutcome([outputs[t.name] for t in info.outputs], answer.queue_us, answer.compute_us,
                            answer.total_us)

    def model_ready(self, name: str) -> bool:
        return self.core.serves(name)

    def ready(self) -> bool:
        return self.core.serves()

    def version(self, name: str, version: str | None = None) -> str:
        serves = str(self.core.model_info(name).extra.get("version", 1))
        if version and version != serves:
            raise UnknownModel(f"model {name!r} has no version {version!r}; it serves version {serves}")
        return serves

    def model_config(self, name: str) -> ModelInfo:
        return self.core.model_info(name)

    def model_metadata(self, name: str) -> dict[str, Any]:
        info = self.core.model_info(name)
        return v2.model_metadata(name, self.version(name), info.inputs, info.outputs, {
            "func_id": info.func_id, "max_batch_size": info.max_batch_size,
            "default_class": info.extra.get("default_class", "be"), "ready": self.core.serves(name)})


@dataclass(frozen=True)
class Registration:
    """A model registered with the cluster through the gateway (``ports.RegisteredModel``)."""

    name: str
    func_id: int  # the cluster's, as the gateway's clients see it
    version: int


class GatewayRegistrar:
    """The gateway as the repository routes see it (``ports.ModelRegistrar``): the cluster's
    management token, registrations sent to the controller through ``upcalls``, the index
    from the routes. A registration answers once the gateway itself serves the model (the
    routes and the nodes' lookups reach it after the controller answered), so a client's
    next call finds it."""

    def __init__(self, core: GatewayCore, upcalls: UpcallClient | None, token: str, timeout_s: float) -> None:
        self.core = core
        self.upcalls = upcalls  # None: no Gateway actor to forward to (management calls are refused)
        self.token = token
        self.timeout_s = timeout_s

    def check_token(self, authorization: str | None) -> None:
        if not self.token:
            raise Unauthorized("this gateway was started without the cluster's management token; it takes no "
                               "management calls")
        check_bearer(authorization, self.token, "the cluster's DATA_DIR/token (written by `splitserve cluster up`)")

    async def _call(self, msg: ModelSpec | UnregisterCall) -> Any:
        if self.upcalls is None:
            raise InternalError("this gateway has no channel to the cluster's controller")
        answer = await self.upcalls.call(msg)
        if isinstance(answer, Failed):
            raise answer.error()
        return answer

    async def register(self, config_toml: str, artifact: bytes | None, labels: str | None) -> Registration:
        name = ModelConfig.from_toml(config_toml).name  # a malformed config is refused here, not on every node
        if any(m == name for m, _ in self.core.routes.models):
            raise InvalidInput(f"model {name!r} already exists in the cluster; unregister it first "
                               f"(DELETE /v2/repository/models/{name})")
        deadline = self._deadline()
        answer = await self._call(ModelSpec(name, config_toml, artifact, labels))
        if not await self._until(lambda: self.core.serves(name), deadline):
            raise ModelNotReady(f"model {name!r} is registered in the cluster (func id {answer.func_id}), but no "
                                f"node serves it at the gateway after {self.timeout_s:g} s")
        version = int(self.core.model_info(name).extra.get("version", 1))
        log.info("registered %s in the cluster through the gateway (func id %d)", name, answer.func_id)
        return Registration(name, answer.func_id, version)

    async def unregister(self, name: str) -> None:
        deadline = self._deadline()
        await self._call(UnregisterCall(name))
        if not await self._until(lambda: all(m != name for m, _ in self.core.routes.models), deadline):
            log.warning("%s was unregistered, but the gateway's routes still named it after %g s", name,
                        self.timeout_s)
        log.info("unregistered %s from the cluster through the gateway", name)

    def _deadline(self) -> float:
        """When a management call must be answered: ``timeout_s`` covers the controller's answer
        and the wait for the gateway to follow it together (the client waits no longer)."""
        return asyncio.get_running_loop().time() + self.timeout_s

    async def _until(self, check: Callable[[], bool], deadline: float) -> bool:
        """Whether ``check`` came to hold by ``deadline``: the controller has answered, and the
        routes it published (and the nodes' lookups) reach the gateway after."""
        try:
            async with asyncio.timeout_at(deadline):
                await self.core.until(check)
        except TimeoutError:
            return False
        return True

    def repository_index(self, ready_only: bool = False) -> list[dict]:
        """Every model of the cluster's routes, READY while some node takes work for it."""
        out = []
        for name, _ in sorted(self.core.routes.models, key=lambda m: m[1]):
            nodes = sum(1 for v in self.core.views() if v.state is NodeState.ACTIVE and name in v.models)
            if ready_only and not nodes:
                continue
            try:
                version = str(self.core.model_info(name).extra.get("version", 1))
            except SplitServeError:  # no node has described it yet
                version = "1"
            out.append({"name": name, "version": version, "state": "READY" if nodes else "UNAVAILABLE",
                        "reason": f"serving on {nodes} node(s)" if nodes else "no node serves it now"})
        return out


def front_ends(core: GatewayCore, config: ServerConfig, registrar: ModelRegistrar | None = None) -> list[FrontEnd]:
    """The decoded front ends over ``core`` that ``config`` turns on: HTTP on
    ``config.frontends.http_port`` and gRPC on ``config.frontends.grpc_port`` (None: off; 0: any free port), on
    ``config.host``, with the node's settings (codec pool, body limits, gRPC stream bound,
    grace). They share one codec pool, so its bound on bodies in hand holds for both, as on
    a node. Of management, both serve the repository calls through ``registrar`` when given
    (HTTP: index, register, unregister; gRPC: ``RepositoryIndex``, and ``RepositoryModelLoad``
    registering a model from its parameters); it has no shared-memory regions registered,
    so a call that names one is refused as naming one not registered. Its HTTP serves
    ``/metrics``: the gateway's own series and every node's (``cluster/gateway/metrics.py``)."""
    serving = GatewayServing(core)
    codec = CodecPool.from_config(config)
    shm = SystemSharedMemory(config.frontends.shm_max_regions, config.frontends.shm_max_bytes)
    out: list[FrontEnd] = []
    if config.frontends.http_port is not None:
        metrics = GatewayMetrics(core)
        out.append(HttpFrontEnd(inference_app(serving, serving, codec, config, shm, metrics=metrics.text,
                                              registrar=registrar), config))
    if config.frontends.grpc_port is not None:
        servicer = (InferenceServicer(serving, serving, codec, config, shm) if registrar is None
                    else RepositoryServicer(serving, serving, codec, config, shm, registrar))
        out.append(GrpcFrontEnd(servicer, config))
    return out


async def run(host: str, port: int, http_port: int | None, grpc_port: int | None, cfg: ClusterConfig,
              upcall_sock: socket.socket | None = None, token: str = "") -> None:
    """Serve the fast path on ``port``, HTTP on ``http_port`` and gRPC on ``grpc_port``
    (None: off; 0: any free port), apply the routes read from stdin, and stop at its EOF.
    ``upcall_sock``: the channel to the Gateway actor for registrations (None: none);
    ``token``: the cluster's management token (empty: no management calls)."""
    core = GatewayCore(cfg)
    bound: dict[str, Any] = {"host": host, "port": await core.serve(host, port), "http_port": None,
                             "grpc_port": None}
    scfg = ServerConfig.from_env(host=host, http_port=http_port, grpc_port=grpc_port)
    upcalls = None if upcall_sock is None else UpcallClient(upcall_sock, scfg.frontends.max_upload_bytes,
                                                             cfg.registration_timeout_s)
    registrar = GatewayRegistrar(core, upcalls, token, cfg.registration_timeout_s)
    started: list[FrontEnd] = []
    try:
        for fe in front_ends(core, scfg, registrar):
            bound.update(await fe.start())
            started.append(fe)
        print(json.dumps(bound), flush=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=cfg.gateway_routes_bytes)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            if line.startswith(b"{"):
                core.update(Routes.from_json(line.decode()))
            elif line.strip() == b"stats":
                print(json.dumps(core.stats()), flush=True)
    finally:
        for fe in reversed(started):
            await fe.stop(scfg.frontends.stop_grace_s)
        if upcalls is not None:
            upcalls.close()
        await core.close()


def main() -> None:
    p = argparse.ArgumentParser(description="splitserve cluster gateway (data plane; started by the Gateway actor)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="fast path over TCP (0: any free port)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP, Open Inference Protocol v2 (0: any; -1: off)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC, Open Inference Protocol v2 (0: any; -1: off)")
    p.add_argument("--upcall-fd", type=int, default=-1,
                   help="a socket to the Gateway actor for registrations (-1: none)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args()
    token = os.environ.pop(TOKEN_ENV, "")  # not handed on to anything this process starts
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    http_port = None if args.http_port < 0 else args.http_port
    grpc_port = None if args.grpc_port < 0 else args.grpc_port
    upcall_sock = None if args.upcall_fd < 0 else socket.socket(fileno=args.upcall_fd)
    asyncio.run(run(args.host, args.port, http_port, grpc_port, ClusterConfig.from_env(), upcall_sock, token))


if __name__ == "__main__":
    main()
