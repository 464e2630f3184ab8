"""`LoRARequest`: which adapter a request runs with, in vLLM's shape (`LoRARequest(lora_name, lora_int_id,
lora_path)`). Host-only, imports nothing from jengine."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name: `lora_path` is a PEFT directory (adapter_config.json + adapter_model.safetensors).

    Requests naming the same `lora_name` share one loaded copy (and one device slot); the name also keys the
    prefix cache, so K/V computed under one adapter is never reused under another."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # vLLM's field: the model the adapter was trained on (informational)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
