"""Engine configuration from vLLM's keyword arguments: what is taken, what is refused and how."""

from __future__ import annotations

import pytest

from jengine.config import EngineConfig
from jengine.errors import ConfigError


def test_config_takes_vllm_arguments_that_change_nothing_and_refuses_the_rest():
    config = EngineConfig.from_kwargs("m", trust_remote_code=True, enforce_eager=False, swap_space=4,
                                      enable_chunked_prefill=True, tokenizer_mode="auto", seed=None)
    assert 0 <= config.model.seed < 2**63 and config.model.seed != EngineConfig.from_kwargs("m", seed=None).model.seed
    # (revision and download_dir choose a hub snapshot before the config is built: tests/models/test_hub.py)
    for name, value in (("pipeline_parallel_size", 2), ("enable_chunked_prefill", False)):
        with pytest.raises(ConfigError, match=f"{name}={value!r} is not supported"):
            EngineConfig.from_kwargs("m", **{name: value})
    with pytest.raises(ConfigError, match="unknown engine argument.*frobnicate"):
        EngineConfig.from_kwargs("m", frobnicate=1)
