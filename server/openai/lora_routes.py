"""LoRA adapters over the OpenAI API, as vLLM serves them: the `model` field names an adapter, /v1/models lists each
with its `parent`, and `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` change them at run time where
runtime updating is switched on (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, read in `jengine/config.py`).

Unloading an adapter that requests still use is refused (400, code `lora_in_use`): those requests finish under it,
and the call can be repeated once they have.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from jengine.clients.protocol import LoraClient
from jengine.errors import InvalidRequestError, NotFoundError
from jengine.lora.request import LoRARequest
from server.json_body import parse_json_body


BodyReader = Callable[[web.Request], Awaitable[bytes]]


class LoraRoutes:
    """The adapters of one `LoraClient` (None: a client without adapters, which names none)."""

    def __init__(self, client: LoraClient | None, base_name: str, created: int, read_body: BodyReader) -> None:
        """`read_body`: the routes' own body reader (size limit, decompression)."""
        self.client = client
        self.base_name = base_name
        self.created = created
        self.read_body = read_body

    def register(self, app: web.Application) -> None:
        if self.client is not None and self.client.allows_runtime_lora_updating():
            app.router.add_post("/v1/load_lora_adapter", self.load)
            app.router.add_post("/v1/unload_lora_adapter", self.unload)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a `model` field names, or None (the base model's names are checked by the caller)."""
        if model is None or self.client is None:
            return None
        return next((r for r in self.client.list_loras() if r.lora_name == model), None)

    def cards(self) -> list[dict[str, Any]]:
        if self.client is None:
            return []
        return [{"id": r.lora_name, "object": "model", "created": self.created, "owned_by": "jengine",
                 "root": r.lora_path, "parent": self.base_name} for r in self.client.list_loras()]

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        known = self.resolve(name)
        if known is not None:
            raise InvalidRequestError(f"the LoRA adapter {name!r} is already loaded", param="lora_name",
                                      code="lora_exists")
        next_id = max((r.lora_int_id for r in self.client.list_loras()), default=0) + 1
        await self.client.add_lora(LoRARequest(name, next_id, path))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("lora_name",))
        name = body["lora_name"]
        if self.resolve(name) is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded", code="lora_not_found")
        await self.client.remove_lora(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _body(self, request: web.Request, fields: tuple[str, ...]) -> dict[str, Any]:
        body = parse_json_body(await self.read_body(request))
        for field in fields:
            if not isinstance(body.get(field), str) or not body[field]:
                raise InvalidRequestError(f"{field} must be a non-empty string", param=field)
        return body
