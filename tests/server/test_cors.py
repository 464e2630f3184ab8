"""A narrowed CORS policy (`--allowed-origins` and friends) on a minimal app with the server's CORS parts: only the
listed origins and methods pass a preflight, and only they get Access-Control-Allow-Origin."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from server import cors


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _app(policy: cors.CorsPolicy) -> web.Application:
    app = web.Application(middlewares=[cors.preflight_middleware(policy)])
    app.router.add_post("/v1/x", _ok)
    cors.install(app, policy)
    return app


async def _exchange(policy: cors.CorsPolicy, origin: str, method: str = "POST") -> tuple[int, dict, dict]:
    async with TestClient(TestServer(_app(policy))) as client:
        preflight = await client.options("/v1/x", headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                           "Access-Control-Request-Headers": "x-custom"})
        call = await client.post("/v1/x", headers={"Origin": origin})
        return preflight.status, dict(preflight.headers), dict(call.headers)


def test_only_listed_origins_and_methods_pass():
    policy = cors.policy_from(["http://ok.example"], ["post"], ["content-type"], credentials=True)
    status, preflight, call = asyncio.run(_exchange(policy, "http://ok.example"))
    assert status == 204 and preflight["Access-Control-Allow-Origin"] == "http://ok.example"
    assert preflight["Access-Control-Allow-Methods"] == "POST"
    assert preflight["Access-Control-Allow-Headers"] == "content-type"  # the list, not the requested header
    assert preflight["Access-Control-Allow-Credentials"] == "true" and preflight["Vary"] == "Origin"
    assert call["Access-Control-Allow-Origin"] == "http://ok.example"
    status, _, call = asyncio.run(_exchange(policy, "http://evil.example"))
    assert status == 400 and "Access-Control-Allow-Origin" not in call
    status, _, _ = asyncio.run(_exchange(policy, "http://ok.example", method="DELETE"))
    assert status == 400


def test_any_origin_with_credentials_names_the_origin():
    """Browsers refuse `*` together with credentials, so the origin itself is returned."""
    policy = cors.policy_from(["*"], ["*"], ["*"], credentials=True)
    _, preflight, call = asyncio.run(_exchange(policy, "http://a.example"))
    assert preflight["Access-Control-Allow-Origin"] == call["Access-Control-Allow-Origin"] == "http://a.example"
    assert preflight["Access-Control-Allow-Headers"] == "x-custom"
