"""What the runner holds for LoRA: the device slots and the host cache their weights come from."""

from __future__ import annotations

import dataclasses
import logging
import time

from jengine.lora.device import DeviceLoraSlots
from jengine.lora.host_cache import AdapterCache

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunnerLora:
    slots: DeviceLoraSlots
    cache: AdapterCache

    def apply(self, loads: dict[int, str], params: dict) -> dict:
        """Writes the adapters the scheduler placed in slots this step (before the step that reads them); returns
        the model weights, whose carried A columns (`DeviceLoraSlots.carry_in`) the writes update."""
        for slot, name in loads.items():
            start = time.perf_counter()
            params = self.slots.load(slot, self.cache.get(name), params)
            logger.debug("LoRA adapter %r written to slot %d in %.3f s", name, slot, time.perf_counter() - start)
        return params
