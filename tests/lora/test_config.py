"""LoRA settings as vLLM spells them: CLI flags and keywords into `EngineConfig.lora`, runtime updating switched on
by vLLM's environment variable (or jengine's), impossible combinations refused. Host only."""

from __future__ import annotations

import pytest

from jengine.cli import build_parser, engine_kwargs
from jengine.config import EngineConfig
from jengine.errors import ConfigError


def test_vllm_lora_flags_reach_the_config():
    args = build_parser().parse_args(["serve", "/m", "--enable-lora", "--lora-modules", "sql=/a/sql",
                                      '{"name": "chat", "path": "/a/chat"}', "--max-loras", "2",
                                      "--max-cpu-loras", "3", "--max-lora-rank", "32"])
    lora = EngineConfig.from_kwargs("/m", **engine_kwargs(args)).lora
    assert (lora.enable_lora, lora.max_loras, lora.cpu_capacity, lora.max_lora_rank) == (True, 2, 3, 32)
    assert lora.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"))


@pytest.mark.parametrize("name", ["VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JENGINE_ALLOW_RUNTIME_LORA_UPDATING"])
def test_runtime_updating_follows_the_environment(monkeypatch, name):
    for variable in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JENGINE_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.delenv(variable, raising=False)
    assert not EngineConfig.from_kwargs("/m", enable_lora=True).lora.allow_runtime_lora_updating
    monkeypatch.setenv(name, "True")
    assert EngineConfig.from_kwargs("/m", enable_lora=True).lora.allow_runtime_lora_updating


@pytest.mark.parametrize("kwargs, message", [
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras must be >= max_loras"),
    (dict(enable_lora=True, max_loras=0), "max_loras must be >= 1"),
    (dict(lora_modules=["a=/a"]), "lora_modules needs enable_lora"),
    (dict(enable_lora=True, lora_modules=["no-path"]), "name=path"),
    (dict(enable_lora=True, tensor_parallel_size=2), "one device"),
])
def test_impossible_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs("/m", **kwargs)
