"""Suite-wide set-up (8 simulated CPU devices, offline HF) and the tiny checkpoints every test package uses:
random-weight models of each supported family built with `transformers` (safetensors), and a tiny BPE tokenizer."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable
from pathlib import Path

import pytest

from jengine.tokenizer.tiny import train_tiny_tokenizer

TOKENIZER_VOCAB = 384


@pytest.fixture(autouse=True)
def pool_fraction_unstated(monkeypatch):
    """Every test starts with JAX's GPU pool fraction unstated: an engine built earlier in the process may have set
    it (`runner/device_pool.py`), and the KV planner reads it."""
    from jengine.runner.device_pool import POOL_FRACTION_VARIABLES

    for name in POOL_FRACTION_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def fresh_seed() -> int:
    """A new seed per run (tests print it on failure); JENGINE_TEST_SEED replays a failing one."""
    import numpy as np

    fixed = os.environ.get("JENGINE_TEST_SEED")
    return int(fixed) if fixed else int(np.random.SeedSequence().entropy % (2**32))

# Shared shape: GQA 4 query heads over 2 KV heads, 3 layers, a vocabulary matching the tiny tokenizer.
COMMON = dict(
    vocab_size=TOKENIZER_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.08,  # larger than HF's 0.02 so greedy choices are not near-ties
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def to_checkpoint_spelling(model_dir: Path) -> None:
    """Rewrites a transformers-5 config.json the way real checkpoints spell it: `rope_theta` + `rope_scaling` at the
    top level and `torch_dtype` instead of `dtype`."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type", "default")
    if rope_type != "default":
        config["rope_scaling"] = {"type": rope_type, **rope}  # older checkpoints say "type"
    config["torch_dtype"] = config.pop("dtype")
    path.write_text(json.dumps(config, indent=2))


# Half of Linux's default vm.max_map_count (65,530): room for one more test module's programs.
MAPPINGS_BEFORE_RELEASE = 32_000


def _mappings() -> int:
    """This process's memory mappings (`/proc/self/maps` lines; 0 where there is none)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """XLA's CPU runtime maps each loaded executable's code and data sections (about three mappings each) for as
    long as JAX's caches hold it. A test worker that has run much of the suite reached the kernel's limit on a
    process's mappings (vm.max_map_count), and the next executable it loaded aborted ("Unable to allocate section
    memory!" in RuntimeDyld, seen in a core dump with 65,532 mappings) or segfaulted. After each module, past half
    that limit, JAX's caches are cleared so unreferenced executables are freed and unmapped (a program needed
    again recompiles or loads from the persistent cache)."""
    yield
    if _mappings() > MAPPINGS_BEFORE_RELEASE:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=TOKENIZER_VOCAB)


@pytest.fixture(scope="session")
def build_checkpoint(tmp_path_factory) -> Callable:
    """build(config, *, spelling="transformers5"|"checkpoint", shard=False, dtype=torch dtype, tokenizer_dir=None)
    -> (dir, hf_model)."""
    import torch

    def build(config, *, spelling: str = "transformers5", shard: bool = False, seed: int = 0, dtype=None,
              tokenizer_dir: Path | None = None):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype or torch.float32)
        model.eval()
        out = tmp_path_factory.mktemp(type(config).__name__)
        model.save_pretrained(out, max_shard_size="60KB" if shard else "5GB")
        if spelling == "checkpoint":
            to_checkpoint_spelling(out)
        if tokenizer_dir is not None:  # a servable model directory: weights and tokenizer together
            for item in Path(tokenizer_dir).iterdir():
                shutil.copy(item, out / item.name)
        return out, model

    return build


def pytest_configure(config: pytest.Config) -> None:
    from tests.crash_retry import register

    register(config)
