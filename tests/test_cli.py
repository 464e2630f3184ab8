"""The `jengine` command as a user runs it (`python -m jengine`, a subprocess, the real engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from tests.conftest import COMMON

ROOT = Path(__file__).resolve().parents[1]


def jengine(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "jengine", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def model_dir(build_checkpoint, tiny_tokenizer_dir) -> Path:
    return build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)[0]


def test_generate_prints_one_completion_per_prompt(model_dir, tmp_path):
    result = jengine("generate", "--model", str(model_dir), "--prompt", "Hello", "--prompt", "你好",
                     "--max-tokens", "5", "--ignore-eos", "--max-model-len", "64",
                     "--compilation-cache-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("generated 5 tokens (length)") == 2
    # stderr is a pipe here, as in a service's log: no progress bar redrawn into it line by line
    assert "Loading weights" not in result.stderr and "Processed prompts" not in result.stderr
    assert "\r" not in result.stderr and "PyTorch was not found" not in result.stderr


def test_features_not_built_are_refused_not_ignored(model_dir):
    result = jengine("generate", "--model", str(model_dir), "--quantization", "awq")
    assert result.returncode == 1 and "quantization='awq' is not supported" in result.stderr
    result = jengine("generate", "--model", str(model_dir), "-pp", "2")
    assert result.returncode == 1 and "pipeline_parallel_size=2 is not supported" in result.stderr


def test_a_vllm_command_line_runs_as_it_is(model_dir, tmp_path):
    """vLLM's aliases, its graph-capture switch, and flags that change nothing here (remote code, swap space, log
    switches)."""
    result = jengine("generate", "--model", str(model_dir), "--prompt", "Hello", "--max-tokens", "3", "--ignore-eos",
                     "--dtype", "half", "--max-model-len", "0.064k", "-tp", "1", "--trust-remote-code",
                     "--enforce-eager", "--disable-log-requests", "--disable-log-stats", "--swap-space", "4",
                     "--enable-chunked-prefill", "--tokenizer-mode", "auto", "--calculate-kv-scales",
                     "--compilation-cache-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "generated 3 tokens" in result.stderr and "float16" in result.stderr


def test_unknown_architecture_is_refused_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    result = jengine("generate", "--model", str(tmp_path))
    assert result.returncode == 1
    assert "GPT2LMHeadModel" in result.stderr and "LlamaForCausalLM" in result.stderr
