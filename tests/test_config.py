"""Engine configuration from vLLM's keyword arguments: what is taken, what is refused and how."""

from __future__ import annotations

import pytest

from jengine.config import EngineConfig
from jengine.errors import ConfigError


def test_config_takes_vllm_arguments_that_change_nothing_and_refuses_the_rest():
    config = EngineConfig.from_kwargs("m", trust_remote_code=True, enforce_eager=False, swap_space=4,
                                      enable_chunked_prefill=True, tokenizer_mode="auto", seed=None,
                                      calculate_kv_scales=True)
    assert 0 <= config.model.seed < 2**63 and config.model.seed != EngineConfig.from_kwargs("m", seed=None).model.seed
    # (revision and download_dir choose a hub snapshot before the config is built: tests/models/test_hub.py)
    for name, value in (("pipeline_parallel_size", 2), ("enable_chunked_prefill", False)):
        with pytest.raises(ConfigError, match=f"{name}={value!r} is not supported"):
            EngineConfig.from_kwargs("m", **{name: value})
    with pytest.raises(ConfigError, match="unknown engine argument.*frobnicate"):
        EngineConfig.from_kwargs("m", frobnicate=1)


def test_chat_parsing_takes_vllm_flags_and_refuses_unknown_parsers():
    from jengine.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "/m", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                                      "--enable-auto-tool-choice"])
    parsing = EngineConfig.from_kwargs("/m", **engine_kwargs(args)).chat_parsing
    assert (parsing.reasoning_parser, parsing.tool_call_parser, parsing.enable_auto_tool_choice) == (
        "qwen3", "hermes", True)
    with pytest.raises(ConfigError, match="tool_call_parser='json' is not one of"):
        EngineConfig.from_kwargs("m", tool_call_parser="json")
    with pytest.raises(ConfigError, match="reasoning_parser='o1' is not one of"):
        EngineConfig.from_kwargs("m", reasoning_parser="o1")
    with pytest.raises(ConfigError, match="enable_auto_tool_choice needs tool_call_parser"):
        EngineConfig.from_kwargs("m", enable_auto_tool_choice=True)
    with pytest.raises(SystemExit):  # argparse lists the parsers it knows
        build_parser().parse_args(["serve", "--tool-call-parser", "json"])


def test_vllm_marlin_quantization_names_mean_the_same_checkpoints():
    """vLLM users pass `--quantization awq_marlin` / `gptq_marlin` for AWQ/GPTQ checkpoints in their usual format:
    they read as awq / gptq (jengine's kernels run them); other names are still refused."""
    from jengine.cli import build_parser, engine_kwargs

    assert EngineConfig.from_kwargs("m", quantization="awq_marlin").model.quantization == "awq"
    assert EngineConfig.from_kwargs("m", quantization="gptq_marlin").model.quantization == "gptq"
    args = build_parser().parse_args(["serve", "m", "--quantization", "gptq_marlin"])
    assert EngineConfig.from_kwargs("m", **engine_kwargs(args)).model.quantization == "gptq"
    with pytest.raises(ConfigError, match="'marlin' is not supported"):
        EngineConfig.from_kwargs("m", quantization="marlin")


def test_gguf_quantization_names_a_gguf_file(tmp_path):
    """vLLM's `--quantization gguf`: accepted for a .gguf file (whose own types decide), refused for anything else."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(20))
    assert EngineConfig.from_kwargs(str(path), quantization="gguf").model.quantization is None
    with pytest.raises(ConfigError, match="quantization='gguf' needs a .gguf file"):
        EngineConfig.from_kwargs(str(tmp_path), quantization="gguf")


def test_every_entry_point_shares_one_compilation_cache_by_default(monkeypatch, tmp_path):
    """`LLM(...)` and the CLI alike: jengine's variable, else the directory JAX was pointed at, else
    ~/.cache/jengine/jax-cache; an empty variable turns it off, an explicit argument wins."""
    from jengine.cli import build_parser, engine_kwargs

    def resolved(**kwargs) -> str | None:
        return EngineConfig.from_kwargs("m", **kwargs).runner.compilation_cache_dir

    def from_cli(*flags: str) -> str | None:
        return resolved(**{k: v for k, v in engine_kwargs(build_parser().parse_args(["serve", "m", *flags])).items()
                           if k == "compilation_cache_dir"})

    monkeypatch.delenv("JENGINE_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolved() == from_cli() == str(tmp_path / ".cache" / "jengine" / "jax-cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert resolved() == from_cli() == str(tmp_path / "jax")
    monkeypatch.setenv("JENGINE_COMPILATION_CACHE_DIR", str(tmp_path / "ours"))
    assert resolved() == from_cli() == str(tmp_path / "ours")
    assert resolved(compilation_cache_dir=str(tmp_path / "mine")) == from_cli("--compilation-cache-dir",
                                                                               str(tmp_path / "mine"))
    assert resolved(compilation_cache_dir=None) is None
    monkeypatch.setenv("JENGINE_COMPILATION_CACHE_DIR", "")
    assert resolved() is None
