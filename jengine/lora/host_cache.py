"""The host LRU of loaded adapters (`max_cpu_loras`) and the registry of the adapters an engine knows by name.

A request names an adapter; the first request (or `add`) reads its directory once and checks it against the base
model, so a bad path or a rank over the limit fails when the adapter is added, not inside a step. Loading into a
device slot reads from this cache; an adapter evicted from it is read again from its directory (the slow path).
Host-only: no jax.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from jengine.errors import AdapterError, NotFoundError
from jengine.lora.peft import LoraAdapter
from jengine.lora.request import LoRARequest

logger = logging.getLogger(__name__)

AdapterReader = Callable[[LoRARequest], LoraAdapter]


class AdapterCache:
    """Known adapters by name, and at most `capacity` of them held in host memory, least recently used evicted."""

    def __init__(self, capacity: int, read: AdapterReader) -> None:
        self.capacity = capacity
        self._read = read
        self._known: dict[str, LoRARequest] = {}
        self._loaded: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()

    def add(self, request: LoRARequest) -> None:
        """Registers (and reads) an adapter; the same name with another path or id is refused."""
        known = self._known.get(request.lora_name)
        if known is not None:
            if (known.lora_path, known.lora_int_id) != (request.lora_path, request.lora_int_id):
                raise AdapterError(f"an adapter named {request.lora_name!r} is already loaded from "
                                   f"{known.lora_path}; unload it first", param="lora_name")
            return
        self._insert(request.lora_name, self._read(request))
        self._known[request.lora_name] = request
        logger.info("LoRA adapter %r loaded from %s", request.lora_name, request.lora_path)

    def remove(self, name: str) -> LoRARequest:
        request = self._known.pop(name, None)
        if request is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded", code="lora_not_found")
        self._loaded.pop(name, None)
        return request

    def get(self, name: str) -> LoraAdapter:
        """The adapter's host arrays; read again from its directory when it was evicted."""
        adapter = self._loaded.get(name)
        if adapter is None:
            adapter = self._read(self.request(name))
            self._insert(name, adapter)
        else:
            self._loaded.move_to_end(name)
        return adapter

    def request(self, name: str) -> LoRARequest:
        request = self._known.get(name)
        if request is None:
            raise NotFoundError(f"no LoRA adapter named {name!r} is loaded", code="lora_not_found")
        return request

    def known(self) -> list[LoRARequest]:
        return list(self._known.values())

    def resident(self) -> list[str]:
        """Names held in host memory, least recently used first."""
        return list(self._loaded)

    def _insert(self, name: str, adapter: LoraAdapter) -> None:
        self._loaded[name] = adapter
        self._loaded.move_to_end(name)
        while len(self._loaded) > self.capacity:
            evicted, _ = self._loaded.popitem(last=False)
            logger.debug("LoRA adapter %r evicted from host memory", evicted)
