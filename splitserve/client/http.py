"""HTTP clients (sync and asyncio) for the Open Inference Protocol v2 front end, with the
same ``lookup`` / ``infer`` / ``infer_result`` API as the fast-path clients, plus model
management helpers (which need the server's token, ``DATA_DIR/token``).

Tensors travel with the binary tensor data extension by default (``binary=False`` sends
and asks for JSON). The server's timings come back in the response ``parameters``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np

from splitserve.client.common import Endpoint, InferResult, ModelInfo, encode_inputs, target_ms
from splitserve.errors import (
    BadSize, DeadlineMissed, DuplicateRequest, InvalidInput, ModelNotReady, Refused, SplitServeError, Status,
    Unauthorized, UnknownModel, WorkerFailed, error_for_status,
)
from splitserve.protocol import v2
from splitserve.protocol.header import RequestClass
from splitserve.types import TensorSpec

LABELS_FILE = "labels.txt"  # the labels file ``register`` uploads when a model directory has one
REGISTER_TIMEOUT_S = 300.0  # registering loads the model before the server answers

_BY_HTTP: dict[int, type[SplitServeError]] = {
    400: InvalidInput, 401: Unauthorized, 404: UnknownModel, 409: DuplicateRequest, 413: InvalidInput,
    429: Refused, 500: WorkerFailed, 503: ModelNotReady, 504: DeadlineMissed,
}


def _base_url(url: str) -> str:
    ep = Endpoint.parse(url)
    if ep.scheme != "http":
        raise InvalidInput(f"HttpClient speaks http://, got {url!r}")
    return f"http://{ep.host}:{ep.port}{ep.path.rstrip('/')}"


def _raise_for(r: httpx.Response) -> None:
    """A typed SplitServeError from an error answer."""
    if r.is_success:
        return
    try:
        body = r.json()
        message, code = str(body.get("error", r.text)), body.get("status")
    except ValueError:
        message, code = r.text or r.reason_phrase, None
    if isinstance(code, str) and code in Status.__members__:
        raise error_for_status(Status[code], message)
    raise _BY_HTTP.get(r.status_code, SplitServeError)(message)


def _model_info(doc: dict) -> ModelInfo:
    def specs(ts: list[dict]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t["name"], t["datatype"], tuple(int(d) for d in t["shape"][1:])) for t in ts)

    params = doc.get("parameters") or {}
    return ModelInfo(doc["name"], int(params.get("func_id", 0)), specs(doc["inputs"]), specs(doc["outputs"]),
                     int(params.get("max_batch_size", 1)), doc)


def _infer_body(info: ModelInfo, x: Any, cls: Any, deadline_ms: float | None, slo_ms: float | None,
                binary: bool) -> tuple[bytes, dict[str, str], int, bool]:
    arrays, count, batched = encode_inputs(info, x)
    params: dict[str, Any] = {}
    c = RequestClass.parse(cls)
    if c != RequestClass.DEFAULT:
        params["class"] = "rt" if c == RequestClass.RT else "be"
    for name, value in (("deadline_ms", deadline_ms), ("slo_ms", slo_ms)):
        if value is not None:
            params[name] = target_ms(value, name)
    parts, hlen = v2.build_infer_request([(t.name, a) for t, a in zip(info.inputs, arrays)], binary=binary,
                                         parameters=params)
    if hlen is None:
        headers = {"Content-Type": v2.JSON_CONTENT_TYPE}
    else:
        headers = {"Content-Type": v2.BINARY_CONTENT_TYPE, v2.HEADER_LENGTH: str(hlen)}
    return b"".join(parts), headers, count, batched


def _infer_result(info: ModelInfo, r: httpx.Response, batched: bool) -> InferResult:
    _raise_for(r)
    resp = v2.parse_infer_response(r.content, r.headers.get(v2.HEADER_LENGTH))
    outs = {}
    for spec in info.outputs:
        a = resp.outputs.get(spec.name)
        if a is None:
            raise BadSize(f"the response of {info.name!r} lacks output {spec.name!r}")
        outs[spec.name] = a if batched else a[0]
    p = resp.parameters
    return InferResult(outs, int(p.get("queue_us", 0)), int(p.get("compute_us", 0)), int(p.get("total_us", 0)))


def with_device(text: str, device: str) -> str:
    """config.toml's ``text`` with its top-level ``device`` set to ``device`` (``register``'s
    override): a ``device`` line before the first table is replaced, else one is added."""
    lines = text.splitlines()
    tables = next((k for k, line in enumerate(lines) if line.lstrip().startswith("[")), len(lines))
    kept = [line for k, line in enumerate(lines)
            if k >= tables or line.split("=", 1)[0].strip() != "device" or "=" not in line]
    out = f"device = {json.dumps(device)}\n" + "\n".join(kept) + "\n"
    if tomllib.loads(out).get("device") != device:
        raise InvalidInput(f"device {device!r} could not be written into config.toml")
    return out


def _register_files(model_dir: Path, device: str | None = None) -> tuple[str, dict[str, tuple[str, bytes, str]]]:
    """The model name and multipart files of a model directory (config.toml, artifact, labels);
    ``device``: serve it there whatever its config.toml says."""
    model_dir = Path(model_dir)
    cfg_file = model_dir / "config.toml"
    if not cfg_file.is_file():
        raise InvalidInput(f"{model_dir} has no config.toml")
    text = cfg_file.read_text()
    try:
        if device is not None:
            text = with_device(text, device)
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidInput(f"{cfg_file} is not valid TOML: {e}") from None
    name = doc.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"{cfg_file} has no name")
    files = {"config": ("config.toml", text.encode(), "text/plain")}
    art = (doc.get("artifact") or {}).get("file")
    if art:
        path = model_dir / art
        if not path.is_file():
            raise InvalidInput(f"{model_dir}: artifact file {art!r} is missing")
        files["artifact"] = (art, path.read_bytes(), "application/octet-stream")
    labels = model_dir / LABELS_FILE
    if labels.is_file():
        files["labels"] = (LABELS_FILE, labels.read_bytes(), "text/plain")
    return name, files


def _load_body(keep_resident: bool | None) -> dict[str, Any] | None:
    return None if keep_resident is None else {"parameters": {"keep_resident": keep_resident}}


def _auth(token: str | None) -> dict[str, str]:
    if not token:
        raise Unauthorized("management calls need the server's token (the file DATA_DIR/token)")
    return {"Authorization": f"Bearer {token}"}


def _m(name: str) -> str:
    return quote(name, safe="")


class HttpClient:
    """Synchronous HTTP client: ``lookup``, ``infer``, ``infer_result`` and management.

    Thread-safe (one ``httpx.Client`` with a connection pool).
    """

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None) -> None:
        self.url = _base_url(url)
        self.token = token
        self.http = httpx.Client(base_url=self.url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        self._models: dict[str, ModelInfo] = {}

    # -- inference --------------------------------------------------------------------

    def lookup(self, model: str) -> ModelInfo:
        """The model's inputs, outputs and func_id (v2 metadata; cached)."""
        info = self._models.get(model)
        if info is None:
            r = self.http.get(f"/v2/models/{_m(model)}")
            _raise_for(r)
            info = self._models[model] = _model_info(r.json())
        return info

    def infer_result(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
                     slo_ms: float | None = None, binary: bool = True) -> InferResult:
        info = self.lookup(model)
        body, headers, _, batched = _infer_body(info, x, cls, deadline_ms, slo_ms, binary)
        r = self.http.post(f"/v2/models/{_m(model)}/infer", content=body, headers=headers)
        return _infer_result(info, r, batched)

    def infer(self, model: str, x: Any, **kw: Any) -> "np.ndarray | dict[str, np.ndarray]":
        """numpy in, numpy out: the single output, or a dict of outputs."""
        return self.infer_result(model, x, **kw).value()

    # -- health, repository, statistics -----------------------------------------------------

    def _get(self, path: str) -> Any:
        r = self.http.get(path)
        _raise_for(r)
        return r.json()

    def live(self) -> bool:
        return self.http.get("/v2/health/live").status_code == 200

    def ready(self, model: str | None = None) -> bool:
        r = self.http.get(f"/v2/models/{_m(model)}/ready" if model else "/v2/health/ready")
        if r.status_code == 404:
            _raise_for(r)
        return r.status_code == 200

    def index(self, ready_only: bool = False) -> list[dict]:
        r = self.http.post("/v2/repository/index", json={"ready": ready_only})
        _raise_for(r)
        return r.json()

    def stats(self, model: str | None = None) -> dict:
        return self._get(f"/v2/models/{_m(model)}/stats" if model else "/v2/models/stats")

    def memory(self) -> dict:
        """``GET /v2/memory``: the memory manager's budget, LRU order and each model's residency."""
        return self._get("/v2/memory")

    def metadata(self, model: str) -> dict:
        """v2 model metadata; its ``parameters`` carry func_id and state (splitserve additions)."""
        return self._get(f"/v2/models/{_m(model)}")

    def metrics(self) -> str:
        r = self.http.get("/metrics")
        _raise_for(r)
        return r.text

    def classify(self, model: str, x: Any, top_k: int = 5) -> list[list[dict]]:
        r = self.http.post("/classify", json={"model": model, "input": np.asarray(x).tolist(), "top_k": top_k})
        _raise_for(r)
        return r.json()["predictions"]

    # -- management (token) -----------------------------------------------------------

    def register(self, model_dir: "str | Path", token: str | None = None,
                 timeout: float = REGISTER_TIMEOUT_S, device: str | None = None) -> dict:
        """Upload a model directory (config.toml, its artifact, labels.txt); returns when loaded.
        ``device`` (cpu, cuda, cuda:N) overrides its config's."""
        name, files = _register_files(Path(model_dir), device)
        r = self.http.post(f"/v2/repository/models/{_m(name)}/register", files=files,
                           headers=_auth(token or self.token), timeout=timeout)
        _raise_for(r)
        return r.json()

    def unregister(self, model: str, token: str | None = None) -> None:
        _raise_for(self.http.delete(f"/v2/repository/models/{_m(model)}", headers=_auth(token or self.token)))
        self._models.pop(model, None)

    def load(self, model: str, token: str | None = None, timeout: float = REGISTER_TIMEOUT_S,
             keep_resident: bool | None = None) -> None:
        """Load ``model`` and wait until it serves; ``keep_resident`` (None: unchanged) sets
        whether the server's memory manager may evict it."""
        _raise_for(self.http.post(f"/v2/repository/models/{_m(model)}/load", headers=_auth(token or self.token),
                                  timeout=timeout, json=_load_body(keep_resident)))

    def unload(self, model: str, token: str | None = None) -> None:
        _raise_for(self.http.post(f"/v2/repository/models/{_m(model)}/unload", headers=_auth(token or self.token)))

    def evict(self, model: str, token: str | None = None, timeout: float = REGISTER_TIMEOUT_S) -> dict:
        """Release the model's weights but keep serving it (the next call loads it again);
        returns ``{"name", "evicted", "state"}``."""
        r = self.http.post(f"/v2/repository/models/{_m(model)}/evict", headers=_auth(token or self.token),
                           timeout=timeout)
        _raise_for(r)
        return r.json()

    def configure(self, model: str, token: str | None = None, **changes: Any) -> dict:
        """``instances=``, ``batching={...}``, ``max_batch_size=``; returns the live config."""
        r = self.http.post(f"/v2/repository/models/{_m(model)}/config", json=changes,
                           headers=_auth(token or self.token), timeout=REGISTER_TIMEOUT_S)
        _raise_for(r)
        return r.json()

    def scale(self, model: str, instances: int, token: str | None = None) -> dict:
        return self.configure(model, token, instances=instances)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "HttpClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncHttpClient:
    """asyncio HTTP client with the same API (``await c.infer(...)``)."""

    def __init__(self, url: str, timeout: float = 60.0, token: str | None = None) -> None:
        self.url = _base_url(url)
        self.token = token
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout,
                                      limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        self._models: dict[str, ModelInfo] = {}

    async def lookup(self, model: str) -> ModelInfo:
        info = self._models.get(model)
        if info is None:
            r = await self.http.get(f"/v2/models/{_m(model)}")
            _raise_for(r)
            info = self._models[model] = _model_info(r.json())
        return info

    async def infer_result(self, model: str, x: Any, *, cls: Any = None, deadline_ms: float | None = None,
                           slo_ms: float | None = None, binary: bool = True) -> InferResult:
        info = await self.lookup(model)
        body, headers, _, batched = _infer_body(info, x, cls, deadline_ms, slo_ms, binary)
        r = await self.http.post(f"/v2/models/{_m(model)}/infer", content=body, headers=headers)
        return _infer_result(info, r, batched)

    async def infer(self, model: str, x: Any, **kw: Any) -> "np.ndarray | dict[str, np.ndarray]":
        return (await self.infer_result(model, x, **kw)).value()

    async def register(self, model_dir: "str | Path", token: str | None = None,
                       timeout: float = REGISTER_TIMEOUT_S, device: str | None = None) -> dict:
        name, files = _register_files(Path(model_dir), device)
        r = await self.http.post(f"/v2/repository/models/{_m(name)}/register", files=files,
                                 headers=_auth(token or self.token), timeout=timeout)
        _raise_for(r)
        return r.json()

    async def load(self, model: str, token: str | None = None, keep_resident: bool | None = None) -> None:
        _raise_for(await self.http.post(f"/v2/repository/models/{_m(model)}/load", headers=_auth(token or self.token),
                                        timeout=REGISTER_TIMEOUT_S, json=_load_body(keep_resident)))

    async def unload(self, model: str, token: str | None = None) -> None:
        _raise_for(await self.http.post(f"/v2/repository/models/{_m(model)}/unload",
                                        headers=_auth(token or self.token)))

    async def evict(self, model: str, token: str | None = None) -> dict:
        """Release the model's weights but keep serving it (see ``HttpClient.evict``)."""
        r = await self.http.post(f"/v2/repository/models/{_m(model)}/evict", headers=_auth(token or self.token),
                                 timeout=REGISTER_TIMEOUT_S)
        _raise_for(r)
        return r.json()

    async def scale(self, model: str, instances: int, token: str | None = None) -> dict:
        r = await self.http.post(f"/v2/repository/models/{_m(model)}/config", json={"instances": instances},
                                 headers=_auth(token or self.token), timeout=REGISTER_TIMEOUT_S)
        _raise_for(r)
        return r.json()

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncHttpClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
