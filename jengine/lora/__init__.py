"""Multi-LoRA serving: PEFT adapter directories read on the host (`peft.py`), a host LRU of loaded adapters
(`host_cache.py`), the scheduler's table of device slots (`slots.py`, integers only) and the runner's stacked
slot arrays (`device.py`). `request.py` is vLLM's `LoRARequest`. Nothing here but `device.py` imports jax."""
