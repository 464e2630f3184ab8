"""Cross-origin requests (CORS), allowed from any origin by default as vLLM's server does, so a browser page can call
the API; `--allowed-origins` (and methods, headers, credentials) narrow it.

Preflights (OPTIONS carrying Access-Control-Request-Method) are answered here, before authentication: browsers send
them without the API key. Every response to an allowed origin carries Access-Control-Allow-Origin, set as its headers
go out (`on_response_prepare`), so streams and error responses have it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from aiohttp import web

from jengine.errors import InvalidRequestError
from server.http_limits import error_response

ANY = "*"
PREFLIGHT_MAX_AGE_S = 600


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = (ANY,)
    methods: tuple[str, ...] = (ANY,)
    headers: tuple[str, ...] = (ANY,)
    credentials: bool = False

    def allows(self, origin: str) -> bool:
        return ANY in self.origins or origin in self.origins

    def allow_origin(self, origin: str) -> str:
        """The origin itself where credentials are allowed (browsers refuse `*` with them) or origins are listed."""
        return ANY if ANY in self.origins and not self.credentials else origin

    def cors_headers(self, origin: str) -> dict[str, str]:
        headers = {"Access-Control-Allow-Origin": self.allow_origin(origin)}
        if headers["Access-Control-Allow-Origin"] != ANY:
            headers["Vary"] = "Origin"
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight_headers(self, origin: str, method: str, requested_headers: str) -> dict[str, str]:
        return {
            **self.cors_headers(origin),
            "Access-Control-Allow-Methods": method if ANY in self.methods else ", ".join(self.methods),
            "Access-Control-Allow-Headers": requested_headers if ANY in self.headers else ", ".join(self.headers),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }


def policy_from(origins: Sequence[str], methods: Sequence[str], headers: Sequence[str],
                credentials: bool) -> CorsPolicy:
    return CorsPolicy(tuple(origins), tuple(m.upper() for m in methods), tuple(headers), credentials)


def install(app: web.Application, policy: CorsPolicy) -> None:
    """Adds the response hook; `preflight_middleware(policy)` must be the app's first middleware."""

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin and policy.allows(origin) and "Access-Control-Allow-Origin" not in response.headers:
            response.headers.update(policy.cors_headers(origin))

    app.on_response_prepare.append(add_headers)


def preflight_middleware(policy: CorsPolicy):
    """Answers CORS preflights (204, or 400 for an origin or method not allowed); passes everything else on."""

    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or not origin or not method:
            return await handler(request)
        if not policy.allows(origin) or (ANY not in policy.methods and method.upper() not in policy.methods):
            return error_response(InvalidRequestError(f"cross-origin {method} from {origin[:100]} is not allowed",
                                                      code="cors_not_allowed"))
        requested = request.headers.get("Access-Control-Request-Headers", "")
        return web.Response(status=204, headers=policy.preflight_headers(origin, method.upper(), requested))

    return preflight
