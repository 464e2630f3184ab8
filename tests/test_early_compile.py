"""Step programs compiled while the weights load (`runner/early_compile.py`): the weights' shapes told before loading
are the loaded ones, the real runner then compiles nothing, and a prediction that misses falls back safely."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import jax
import numpy as np
from jax._src import monitoring
import pytest
from transformers import LlamaConfig, Qwen2Config

from jengine import LLM, SamplingParams
from jengine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jengine.factory import deterministic_params, expected_weights, load_weights
from jengine.models.loader import load_spec
from jengine.parallel.mesh import build_mesh
from jengine.parallel.sharding import plan_layout
from jengine.runner.early_compile import EarlyCompile, bytes_per_device, first_difference
from jengine.runner.kv_storage import KVPlan, plan_kv_cache
from tests.conftest import COMMON


@pytest.fixture(scope="module")
def checkpoints(build_checkpoint, tiny_tokenizer_dir):
    llama = LlamaConfig(**{**COMMON, "num_hidden_layers": 2, "max_position_embeddings": 64})
    qwen2 = Qwen2Config(**{**COMMON, "num_hidden_layers": 2, "max_position_embeddings": 64,
                           "tie_word_embeddings": True})
    return {name: build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)[0]
            for name, config in (("llama", llama), ("qwen2-tied", qwen2))}


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("deterministic", [False, True])
def test_expected_weights_are_the_loaded_ones(checkpoints, family, load_format, tp, deterministic):
    model = ModelConfig(model=str(checkpoints[family]), load_format=load_format, dtype="bfloat16")
    spec = load_spec(model.model)
    layout = plan_layout(spec, build_mesh(jax.devices()[:tp]), False)
    expected_spec, expected, expected_dtype = expected_weights(model, layout)
    loaded_spec, loaded, loaded_dtype = load_weights(model, layout)
    if deterministic:
        expected = deterministic_params(expected, expected_spec, layout, "cpu")
        loaded = deterministic_params(loaded, loaded_spec, layout, "cpu")
    assert (expected_spec, expected_dtype) == (loaded_spec, loaded_dtype)
    assert first_difference(expected, loaded) is None
    assert bytes_per_device(expected) == bytes_per_device(loaded)
    per_device = sum(shard.data.nbytes for leaf in jax.tree.leaves(loaded) for shard in leaf.addressable_shards
                     if shard.device == jax.devices()[0])
    assert bytes_per_device(loaded) == per_device


def test_a_quantized_config_is_not_predicted(checkpoints):
    model = ModelConfig(model=str(checkpoints["llama"]), quantization="fp8")
    layout = plan_layout(load_spec(model.model), build_mesh(jax.devices()[:1]), False)
    assert expected_weights(model, layout) is None


def test_first_difference_names_the_leaf():
    a = {"w": jax.ShapeDtypeStruct((4, 8), np.float32), "b": jax.ShapeDtypeStruct((8,), np.float32)}
    assert first_difference(a, dict(a)) is None
    changed = {**a, "w": jax.ShapeDtypeStruct((4, 9), np.float32)}
    assert "['w']" in first_difference(a, changed)
    assert first_difference(a, {"w": a["w"]}) == "the parameter tree"


class FakeDevice:
    def __init__(self, in_use: int) -> None:
        self.stats = {"bytes_limit": 8 << 30, "bytes_in_use": in_use}

    def memory_stats(self) -> dict:
        return self.stats


def test_a_plan_before_loading_counts_the_weights_to_come(checkpoints):
    spec = load_spec(checkpoints["llama"])
    sched = SchedulerConfig(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64)
    weights = 200 << 20
    before = plan_kv_cache(spec, CacheConfig(), sched, jax.numpy.bfloat16, FakeDevice(0), weights_to_come=weights)
    after = plan_kv_cache(spec, CacheConfig(), sched, jax.numpy.bfloat16, FakeDevice(weights))
    assert before.num_blocks == after.num_blocks > 0


def _plan(blocks: int) -> KVPlan:
    return KVPlan(blocks, 16, 1024, "test", np.dtype("float32"))


def _early(params: dict, blocks: int, error: Exception | None = None) -> EarlyCompile:
    future: Future = Future()
    future.set_exception(error) if error else future.set_result(None)
    return EarlyCompile(params, _plan(blocks), False, future, 0.0)


def test_settle_keeps_the_compiled_plan_only_where_it_fits(caplog):
    params = {"w": jax.ShapeDtypeStruct((2, 2), np.float32)}
    assert _early(params, 100).settle(params, _plan(103)).num_blocks == 100  # the slack left unused
    with caplog.at_level(logging.INFO, logger="jengine.runner.early_compile"):
        assert _early(params, 100).settle(params, _plan(99)).num_blocks == 99
        assert "fewer than the 100 planned" in caplog.text
        other = {"w": jax.ShapeDtypeStruct((2, 3), np.float32)}
        assert _early(params, 100).settle(other, _plan(120)).num_blocks == 120
        assert "differ from the expected" in caplog.text
        assert _early(params, 100, RuntimeError("boom")).settle(params, _plan(120)).num_blocks == 120
        assert "boom" in caplog.text


def test_the_engine_compiles_its_programs_while_loading_and_then_none(checkpoints, caplog, monkeypatch):
    """With `compile_buckets="all"` the step programs are compiled before the weights are needed; once that is done
    the runner's own start-up traces no forward program again, and the engine's output is the one an engine
    compiling lazily gives. (Unusual limits: no other test's programs are in the caches.)"""
    options = dict(dtype="float32", max_model_len=40, max_num_seqs=5, max_num_batched_tokens=24, seed=0)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 20)]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    events = []
    settle = EarlyCompile.settle

    def settle_marked(self, *args):
        plan = settle(self, *args)
        events.append("settled")
        return plan

    monkeypatch.setattr(EarlyCompile, "settle", settle_marked)
    monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: events.append(kw.get("fun_name")) if event.endswith("jaxpr_trace_duration") else None)
    try:
        with caplog.at_level(logging.INFO, logger="jengine"):
            llm = LLM(str(checkpoints["llama"]), compile_buckets="all", **options)
    finally:
        monitoring.clear_event_listeners()
    with llm:
        assert "step programs compiled while the weights loaded" in caplog.text
        assert "settled" in events and "forward_step" in events[:events.index("settled")]
        assert "forward_step" not in events[events.index("settled"):], "the runner traced a forward program again"
        early = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    with LLM(str(checkpoints["llama"]), compile_buckets="lazy", **options) as llm:
        lazy = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert early == lazy
