"""Adapter directories: what is read (fused projections split, rsLoRA scaling), what is refused and how clearly;
the host LRU's eviction order; prefix-cache keys that differ per adapter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from jengine import LLM, LoRARequest
from jengine.cache.hashing import hash_blocks
from jengine.errors import AdapterError
from jengine.lora.host_cache import AdapterCache
from jengine.lora.peft import LoraAdapter, read_adapter
from jengine.models.loader import load_spec

PREFIX = "base_model.model.model.layers.{i}."


def _write(directory, tensors: dict[str, np.ndarray], **config) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                               "target_modules": ["q_proj"], **config}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def spec(lora_base):
    return load_spec(lora_base[0])


def test_fused_qkv_adapter_splits_into_its_parts(spec, tmp_path):
    """A `qkv_proj` pair (one A, B over q|k|v rows) reads as q, k, v pairs sharing that A; rsLoRA scales by
    alpha/sqrt(r)."""
    rng = np.random.default_rng(0)
    d, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    a = rng.standard_normal((4, d)).astype(np.float32)
    b = rng.standard_normal((q + 2 * kv, 4)).astype(np.float32)
    path = _write(tmp_path / "fused", {PREFIX.format(i=1) + "self_attn.qkv_proj.lora_A.weight": a,
                                       PREFIX.format(i=1) + "self_attn.qkv_proj.lora_B.weight": b},
                  target_modules=["qkv_proj"], use_rslora=True)
    adapter = read_adapter("fused", path, spec, max_rank=8)
    scale = 8 / np.sqrt(4)
    parts = adapter.layers[1]
    assert set(parts) == {"q", "k", "v"} and not adapter.layers[0] and adapter.rank == 4
    for name, rows in (("q", b[:q]), ("k", b[q:q + kv]), ("v", b[q + kv:])):
        np.testing.assert_array_equal(parts[name][0], a.T)
        np.testing.assert_allclose(parts[name][1], rows.T * scale, rtol=1e-6)


@pytest.mark.parametrize("config, tensors, message", [
    ({"use_dora": True}, None, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, None, "embedding"),
    ({"bias": "all"}, None, "bias"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 384), np.float32)},
     "embed_tokens.lora_embedding_A"),
    ({}, {PREFIX.format(i=0) + "self_attn.q_proj.lora_A.weight": np.zeros((4, 64), np.float32)}, "without its pair"),
    ({}, {PREFIX.format(i=0) + "self_attn.q_proj.lora_A.weight": np.zeros((4, 32), np.float32),
          PREFIX.format(i=0) + "self_attn.q_proj.lora_B.weight": np.zeros((64, 4), np.float32)}, r"\[r, 64\]"),
    ({}, {PREFIX.format(i=0) + "self_attn.q_proj.lora_A.weight": np.zeros((32, 64), np.float32),
          PREFIX.format(i=0) + "self_attn.q_proj.lora_B.weight": np.zeros((64, 32), np.float32)},
     "rank 32.*max_lora_rank=16"),
])
def test_unsupported_adapters_are_refused_by_name(spec, tmp_path, config, tensors, message):
    good = {PREFIX.format(i=0) + "self_attn.q_proj.lora_A.weight": np.zeros((4, 64), np.float32),
            PREFIX.format(i=0) + "self_attn.q_proj.lora_B.weight": np.zeros((64, 4), np.float32)}
    path = _write(tmp_path / "bad", tensors or good, **config)
    with pytest.raises(AdapterError, match=message):
        read_adapter("bad", path, spec, max_rank=16)


def test_bad_paths_and_ranks_are_clear_errors_at_generate(lora_base, make_adapter, tmp_path):
    """Raised by generate before any prompt runs; the engine serves the next call normally."""
    model_dir, _ = lora_base
    rank8, _ = make_adapter(8, seed=5)
    (tmp_path / "empty").mkdir()
    with LLM(str(model_dir), dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=4) as llm:
        with pytest.raises(AdapterError, match="not found"):
            llm.generate("hi", lora_request=LoRARequest("missing", 1, str(tmp_path / "nowhere")), use_tqdm=False)
        with pytest.raises(AdapterError, match="adapter_config.json"):
            llm.generate("hi", lora_request=LoRARequest("empty", 2, str(tmp_path / "empty")), use_tqdm=False)
        with pytest.raises(AdapterError, match="rank 8.*max_lora_rank=4"):
            llm.generate("hi", lora_request=LoRARequest("big", 3, str(rank8)), use_tqdm=False)
        assert not llm._core.has_unfinished()
        assert len(llm.generate("hi", use_tqdm=False)) == 1


def test_host_cache_evicts_least_recently_used():
    reads: list[str] = []

    def read(request: LoRARequest) -> LoraAdapter:
        reads.append(request.lora_name)
        return LoraAdapter(request.lora_name, request.lora_path, 1, ())

    cache = AdapterCache(2, read)
    for i, name in enumerate("abc"[:2]):
        cache.add(LoRARequest(name, i + 1, f"/{name}"))
    cache.get("a")  # b is now the least recently used
    cache.add(LoRARequest("c", 3, "/c"))
    assert cache.resident() == ["a", "c"]
    cache.get("b")  # evicted: read again from its path, evicting a
    assert cache.resident() == ["c", "b"] and reads == ["a", "b", "c", "b"]
    assert [r.lora_name for r in cache.known()] == ["a", "b", "c"]
    with pytest.raises(AdapterError, match="already loaded"):
        cache.add(LoRARequest("a", 9, "/elsewhere"))


def test_prefix_cache_keys_include_the_adapter():
    tokens = list(range(32))
    base, one, other = (hash_blocks(tokens, 16, lora_name=n) for n in (None, "one", "other"))
    assert len({base[0], one[0], other[0]}) == 3
    assert hash_blocks(tokens, 16, lora_name="one") == one
