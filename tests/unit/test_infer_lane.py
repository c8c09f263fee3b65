"""The infer lane (server/http/infer_lane.py): v2 infer calls reach their handler without the
router, with the path's parameters the router would give, and answer errors as the app
does; every other request goes on to the app. In process, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from fastapi import Request
from fastapi.responses import Response

from splitserve.errors import UnknownModel
from splitserve.server.http.base import new_app
from splitserve.server.http.infer_lane import INFER_PATH, InferLane


def _app(seen: list[tuple[str, str | None, bytes]]):
    app = new_app("infer lane test", [])

    async def infer(name: str, request: Request, version: str | None = None) -> Response:
        body = await request.body()
        seen.append((name, version, body))
        if name == "boom":
            raise RuntimeError("a bug in the handler")
        if name == "missing":
            raise UnknownModel(f"model {name!r} is not registered")
        return Response(b"ran " + name.encode(), media_type="application/octet-stream")

    async def routed(name: str) -> Response:  # the documented route: the lane must have taken the call first
        pytest.fail(f"the router served an infer call for {name!r}")

    app.post("/v2/models/{name}/infer")(routed)
    app.post("/v2/models/{name}/versions/{version}/infer")(routed)

    @app.get("/v2/models/{name}")
    async def metadata(name: str) -> dict:
        return {"name": name}

    app.add_middleware(InferLane, infer=infer)
    return app


def _run(app, method: str, path: str, body: bytes = b"") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://lane") as client:
            return await client.request(method, path, content=body)

    return asyncio.run(go())


def test_infer_calls_reach_the_handler_with_the_paths_parameters_and_the_body():
    seen: list = []
    app = _app(seen)
    r = _run(app, "POST", "/v2/models/lenet/infer", b"x" * 10)
    assert (r.status_code, r.content) == (200, b"ran lenet")
    r = _run(app, "POST", "/v2/models/lenet/versions/3/infer", b"y")
    assert r.status_code == 200
    r = _run(app, "POST", "/v2/models/my%20model/infer")  # the decoded path, as the router reads it
    assert r.content == b"ran my model"
    assert seen == [("lenet", None, b"x" * 10), ("lenet", "3", b"y"), ("my model", None, b"")]


def test_other_requests_go_to_the_app_and_its_errors():
    seen: list = []
    app = _app(seen)
    assert _run(app, "GET", "/v2/models/lenet").json() == {"name": "lenet"}
    r = _run(app, "GET", "/v2/models/lenet/infer")  # not a POST: the app's 405
    assert r.status_code == 405 and "error" in r.json()
    r = _run(app, "POST", "/v2/models/a/b/infer")  # one segment too many: no such route
    assert r.status_code == 404 and "error" in r.json()
    assert seen == []


def test_errors_are_the_protocols_and_a_bug_is_the_apps_500_with_a_reference():
    app = _app([])
    r = _run(app, "POST", "/v2/models/missing/infer")
    assert r.status_code == 404
    assert r.json() == {"error": "model 'missing' is not registered", "status": "UNKNOWN_MODEL"}
    r = _run(app, "POST", "/v2/models/boom/infer")
    assert r.status_code == 500 and r.json()["status"] == "INTERNAL"
    assert re.search(r"reference [0-9a-f]{12} in the server log", r.json()["error"])


def test_the_lane_takes_the_two_infer_paths_only():
    assert INFER_PATH.fullmatch("/v2/models/m/infer")["version"] is None
    assert INFER_PATH.fullmatch("/v2/models/m/versions/2/infer")["version"] == "2"
    for path in ("/v2/models/m/infer/", "/v2/models//infer", "/v2/models/m/versions//infer", "/v2/models/m",
                 "/v2/models/m/ready", "/v2/repository/models/m/load", "/predictions/m"):
        assert INFER_PATH.fullmatch(path) is None, path
