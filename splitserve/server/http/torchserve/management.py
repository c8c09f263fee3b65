"""TorchServe's management API: register a ``.mar`` (``POST /models?url=...``), list and
describe models, scale workers, set the default version and unregister, each behind the
node's management token sent as TorchServe's token authorization sends its key
(``Authorization: Bearer <key>``).

``url`` names an archive in the model store (``--model-store``; a plain file name, as
TorchServe wants it directly in the store), or with ``--ts-allow-remote-urls`` an http(s)
URL it is downloaded from (within ``max_upload_bytes``). ``batch_size`` and
``max_batch_delay`` (ms) become the model's timeout batching; workers are instances.
Registration and scaling are done when the call answers (``synchronous`` is accepted and
always holds): a model that cannot load is rolled back and the call says why. splitserve
serves one version of a model: a second archive of a name already served is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Request

from splitserve.config import ServerConfig
from splitserve.errors import InvalidInput, NotFound, PayloadTooLarge
from splitserve.models.mar import serve_archive
from splitserve.server.http.base import authorize
from splitserve.server.http.torchserve.base import TorchServeRoute, check_version, known, ts_doc, ts_version
from splitserve.server.management import ModelManager
from splitserve.server.ports import ModelState

REMOTE = ("http://", "https://")
DOWNLOAD_TIMEOUT_S = 120.0  # the whole download of a remote archive


def _read_store(store: Path, url: str, limit: int) -> bytes:
    """The archive ``url`` names in the model store (a file directly in it)."""
    if not url or Path(url).name != url or url.startswith("."):
        raise InvalidInput(f"url {url!r}: name a .mar file directly in the model store {store}, e.g. "
                           "url=resnet-18.mar")
    path = store / url
    if not path.is_file():
        raise NotFound(f"Model not found in model store: {url} (the model store is {store})")
    size = path.stat().st_size
    if size > limit:
        raise PayloadTooLarge(f"{url} is {size} bytes, over the {limit} byte limit (SPLITSERVE_MAX_UPLOAD_BYTES)")
    return path.read_bytes()


async def _download(url: str, limit: int) -> bytes:
    """The archive at an http(s) ``url``, refused past ``limit`` bytes or ``DOWNLOAD_TIMEOUT_S``."""
    chunks: list[bytes] = []
    seen = 0
    try:
        async with asyncio.timeout(DOWNLOAD_TIMEOUT_S), \
                httpx.AsyncClient(timeout=DOWNLOAD_TIMEOUT_S, follow_redirects=True) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidInput(f"downloading {url} answered HTTP {response.status_code}")
                async for chunk in response.aiter_bytes():
                    seen += len(chunk)
                    if seen > limit:
                        raise PayloadTooLarge(f"{url} is over the {limit} byte limit (SPLITSERVE_MAX_UPLOAD_BYTES)")
                    chunks.append(chunk)
    except httpx.HTTPError as e:
        raise InvalidInput(f"could not download {url}: {e}") from None
    except TimeoutError:
        raise InvalidInput(f"downloading {url} took over {DOWNLOAD_TIMEOUT_S:.0f} s") from None
    return b"".join(chunks)


def _opt(params: dict[str, str], key: str) -> str | None:
    value = params.get(key)
    return value if value not in (None, "") else None


def _describe(manager: ModelManager, name: str) -> dict[str, Any]:
    """A model as TorchServe's describe call answers it."""
    served = manager.serving_config(name)
    handler = served.get("handler") or {}
    ready = served["state"] == ModelState.READY
    return {
        "modelName": name, "modelVersion": ts_version(manager, name), "modelUrl": handler.get("archive"),
        "runtime": "python", "minWorkers": served["instances"], "maxWorkers": served["instances"],
        "batchSize": served["dispatch_max_batch"], "maxBatchDelay": served["batching"].get("max_delay_ms"),
        "loadedAtStartup": served["source"] != "registered", "handler": handler.get("name"),
        "state": served["state"],
        "workers": [{"id": str(i), "status": "READY" if ready else "UNLOADED", "gpu": served["device"] != "cpu"}
                    for i in range(served["instances"] if ready else 0)],
    }


def torchserve_management_routes(manager: ModelManager, config: ServerConfig) -> APIRouter:
    """TorchServe's management API over ``manager``; every call needs the token."""
    router = APIRouter(route_class=TorchServeRoute)
    fe = config.frontends
    store = config.model_store_path

    @router.post("/models", **ts_doc("{\"status\": \"Model ... registered with N initial workers\"}",
                                     400, 401, 404, 413, 503, 507))
    async def register(request: Request) -> dict:
        """Register the .mar ``url`` names and load it before answering."""
        authorize(manager, request)
        params = dict(request.query_params)
        url = _opt(params, "url")
        if url is None:
            raise InvalidInput("Parameter url is required.")
        if url.startswith(REMOTE):
            if not fe.ts_allow_remote_urls:
                raise InvalidInput(f"url {url!r} is remote; this server registers archives from its model store "
                                   f"({store}) only, unless started with --ts-allow-remote-urls")
            data, source, from_store = await _download(url, fe.max_upload_bytes), url, False
        elif "://" in url:
            raise InvalidInput(f"url {url!r}: name a .mar in the model store, or an http(s) URL")
        else:
            data = await asyncio.to_thread(_read_store, store, url, fe.max_upload_bytes)
            source, from_store = url, True
        served = await asyncio.to_thread(
            serve_archive, data, fe.max_upload_bytes, name=_opt(params, "model_name"), source=source,
            handler=_opt(params, "handler"), batch_size=_opt(params, "batch_size"),
            max_batch_delay=_opt(params, "max_batch_delay"), workers=_opt(params, "initial_workers"),
            allow_code=fe.allow_code_artifacts)
        rec = await manager.register(served.config_toml, served.artifact, None, from_model_store=from_store)
        if served.workers == 0:
            await manager.unload(rec.name)
        return {"status": f'Model "{rec.name}" Version: {served.archive.version} registered with '
                          f"{served.workers} initial workers"}

    @router.get("/models", **ts_doc("{\"models\": [{\"modelName\", \"modelUrl\"}], \"nextPageToken\"}", 400, 401))
    async def list_models(request: Request, limit: int = 100, next_page_token: int = 0) -> dict:
        """Every model, ``limit`` at a time from ``next_page_token``."""
        authorize(manager, request)
        if not 0 < limit <= 1000 or next_page_token < 0:
            raise InvalidInput("limit must be 1..1000 and next_page_token at least 0")
        names = sorted(manager.records)
        page = names[next_page_token:next_page_token + limit]
        out: dict[str, Any] = {"models": [{"modelName": n, "modelUrl": manager.record(n).config.handler.get("archive")}
                                          for n in page]}
        if next_page_token + limit < len(names):
            out["nextPageToken"] = str(next_page_token + limit)
        return out

    async def describe(model_name: str, request: Request, model_version: str | None = None) -> list:
        """The model (``all`` versions: the one it has) as TorchServe describes it."""
        authorize(manager, request)
        known(manager, model_name)
        check_version(manager, model_name, model_version)
        return [_describe(manager, model_name)]

    described = ts_doc("[the model's description]", 400, 401, 404)
    router.get("/models/{model_name}", **described)(describe)
    router.get("/models/{model_name}/{model_version}", **described)(describe)

    async def scale(model_name: str, request: Request, model_version: str | None = None) -> dict:
        """Scale to ``min_worker`` instances (0: unload); loads an unloaded model first."""
        authorize(manager, request)
        known(manager, model_name)
        check_version(manager, model_name, model_version)
        raw = _opt(dict(request.query_params), "min_worker")
        if raw is None:
            raise InvalidInput("Parameter min_worker is required.")
        try:
            workers = int(raw)
        except ValueError:
            raise InvalidInput(f"min_worker must be an integer, got {raw!r}") from None
        if workers == 0:
            await manager.unload(model_name)
        else:
            if manager.state(model_name) != ModelState.READY:
                await manager.load(model_name)
            await manager.set_instances(model_name, workers)
        return {"status": f"Workers scaled to {workers} for model: {model_name}"}

    scaled = ts_doc("{\"status\": \"Workers scaled to N for model: NAME\"}", 400, 401, 404, 503)
    router.put("/models/{model_name}", **scaled)(scale)
    router.put("/models/{model_name}/{model_version}", **scaled)(scale)

    @router.put("/models/{model_name}/{model_version}/set-default",
                **ts_doc("{\"status\": \"Default version successfully updated ...\"}", 400, 401, 404))
    async def set_default(model_name: str, model_version: str, request: Request) -> dict:
        """The one version splitserve serves is the default; another is not found."""
        authorize(manager, request)
        known(manager, model_name)
        check_version(manager, model_name, model_version)
        return {"status": f'Default version successfully updated for model "{model_name}" to "{model_version}"'}

    async def unregister(model_name: str, request: Request, model_version: str | None = None) -> dict:
        """Unload and delete a model registered at run time."""
        authorize(manager, request)
        known(manager, model_name)
        version = check_version(manager, model_name, model_version)
        await manager.unregister(model_name)
        return {"status": f'Model "{model_name}" Version: {version} unregistered'}

    deleted = ts_doc("{\"status\": \"Model NAME Version: V unregistered\"}", 400, 401, 404)
    router.delete("/models/{model_name}", **deleted)(unregister)
    router.delete("/models/{model_name}/{model_version}", **deleted)(unregister)
    return router
