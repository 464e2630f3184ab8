"""`compile_buckets="all"`: every step shape is compiled at start-up, so serving compiles nothing afterwards."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from transformers import LlamaConfig

from jengine import LLM, SamplingParams
from jengine.runner.buckets import StepBuckets
from jengine.runner.compile import pinned_shapes
from jengine.runner.step import num_compiled_shapes
from tests.conftest import COMMON


@pytest.fixture(scope="module")
def model_dir(build_checkpoint, tiny_tokenizer_dir):
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "max_position_embeddings": 64})
    return build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)[0]


def test_all_buckets_compile_at_start_and_steady_state_compiles_nothing(model_dir, caplog):
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="all") as llm:
        after_start = num_compiled_shapes()
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 17, 40, 9, 30, 2, 12, 33)]
        for params in (SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.7, max_tokens=6)):
            with caplog.at_level(logging.WARNING, logger="jengine.runner.compile"):
                outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
        assert num_compiled_shapes() == after_start, "a step compiled after warm-up"
        assert "compiled after warm-up" not in caplog.text


class _CountingJit:
    """A step jit that counts its calls."""

    def __init__(self, jitted):
        self.jitted, self.calls = jitted, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.jitted(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


@pytest.mark.parametrize("eager_above", [None, 0, 4])
def test_each_step_launches_in_its_policy_mode_with_the_same_tokens(model_dir, monkeypatch, eager_above):
    """A launch policy sends each step to the jits of its mode by the step's `max_query_len` (here prompt chunks of
    5 to 32 tokens and decodes of 1), and the tokens do not depend on the mode."""
    from jengine.runner import runner as runner_module
    from jengine.runner import step
    from jengine.runner.launch import LaunchPolicy

    jits = {eager: tuple(_CountingJit(j) for j in step.STEP_JITS[eager]) for eager in (False, True)}
    for eager, pair in jits.items():
        monkeypatch.setitem(step.STEP_JITS, eager, pair)
    monkeypatch.setattr(runner_module, "launch_policy", lambda platform, enforce_eager: LaunchPolicy(eager_above))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="lazy") as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    forward_calls = {eager: pair[0].calls for eager, pair in jits.items()}
    sampler_calls = {eager: pair[1].calls for eager, pair in jits.items()}
    assert (forward_calls[True] > 0) == (eager_above is not None)  # prompt chunks: eager unless no step is
    assert (forward_calls[False] > 0) == (eager_above != 0)  # decodes: command buffers unless every step is eager
    assert (sampler_calls[True] > 0, sampler_calls[False] > 0) == (eager_above == 0, eager_above != 0)
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="lazy", enforce_eager=False) as llm:  # the CPU's plain jits: the reference tokens
        assert tokens == [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]


def test_speculative_verification_steps_launch_as_decodes(model_dir, monkeypatch):
    """A verification step scores k + 1 rows a request (here 6, over the policy's bound of 4) but runs every decode
    iteration: it takes the decode steps' mode, not the prompt chunks'."""
    from jengine.runner import runner as runner_module
    from jengine.runner import step
    from jengine.runner.launch import LaunchPolicy

    picked = []
    real = step.StepPrograms._forward_jit

    def spying(self, packed, verification=False):
        jitted = real(self, packed, verification)
        picked.append((verification, jitted is step.STEP_JITS[True][0]))
        return jitted

    monkeypatch.setattr(step.StepPrograms, "_forward_jit", spying)
    monkeypatch.setattr(runner_module, "launch_policy", lambda platform, enforce_eager: LaunchPolicy(4))
    prompt = {"prompt_token_ids": list(range(3, 13)) * 4}
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="lazy", speculative_config={"method": "ngram", "num_speculative_tokens": 5}) as llm:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert (True, False) in picked and (True, True) not in picked  # verification steps, none eager
    assert (False, True) in picked  # the prompt's chunks were


def test_the_launch_policy_follows_enforce_eager_and_the_platform():
    from jengine.runner.launch import GRAPH_MAX_QUERY_LEN, launch_policy

    default_gpu = launch_policy("gpu", None)
    assert not default_gpu.eager_for(1) and not default_gpu.eager_for(GRAPH_MAX_QUERY_LEN)
    assert default_gpu.eager_for(GRAPH_MAX_QUERY_LEN + 1) and not default_gpu.eager_sampler
    assert launch_policy("gpu", True).eager_for(1) and launch_policy("gpu", True).eager_sampler
    assert not launch_policy("gpu", False).eager_for(4096) and not launch_policy("cpu", None).eager_for(4096)


def test_start_up_builds_each_step_program_once(model_dir, monkeypatch):
    """Start-up compiles its batches on threads, and the sampler's variants of a shape share one forward: a thread
    that meets a program another is building waits for it instead of compiling it again."""
    import collections

    from jengine.runner import step

    builds = collections.Counter()
    real = step.StepPrograms._build_new

    def counting(self, table, shapes, jitted, args):
        builds[(jitted.__name__, shapes)] += 1
        return real(self, table, shapes, jitted, args)

    monkeypatch.setattr(step.StepPrograms, "_build_new", counting)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # threads, whatever this machine has
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="all"):
        pass
    assert len(builds) > 1 and set(builds.values()) == {1}, builds


def test_start_up_threads_build_different_forwards_at_once(model_dir, monkeypatch):
    """A shape's sampler variants wait for its forward: the threads take every shape's forward first, so 8 threads
    build 8 different forward programs at once (each forward build here holds until that many have begun)."""
    import threading

    from jengine.runner import step

    shapes = pinned_shapes(StepBuckets.build(32, 8, -(-64 // 16)))
    together = threading.Barrier(min(8, len(shapes)), timeout=20)
    broken = []
    real = step.StepPrograms._build_new

    def gathering(self, table, shapes, jitted, args):
        if jitted.__name__ == step._forward_step.__name__ and not together.broken:
            try:
                together.wait()
            except threading.BrokenBarrierError:
                broken.append(shapes)
        return real(self, table, shapes, jitted, args)

    monkeypatch.setattr(step.StepPrograms, "_build_new", gathering)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="all"):
        pass
    assert together.parties > 2 and not broken, f"forwards built at once fell short of {together.parties}"


def test_auto_compiles_up_front_only_with_a_kernel_backend(model_dir):
    """`auto` (the default of every entry point) pins and precompiles with a kernel backend; with the jnp reference
    (the CPU) it compiles lazily, so a CPU engine starts in seconds."""
    from jengine.cli import build_parser

    for command in (["serve", "m"], ["generate", "--model", "m"], ["bench", "throughput", "--model", "m"]):
        assert build_parser().parse_args(command).compile_buckets == "auto", command
    before = num_compiled_shapes()
    with LLM(str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32) as llm:
        assert llm._core.config.runner.compile_buckets == "auto"
        assert llm._core.runner.backend.name == "reference"
        assert not llm._core.runner.batch.pin_shapes
        assert num_compiled_shapes() == before


PRECOMPILE_PROBE = """
import json, sys, threading
import jax
from jengine import LLM

compiles = {"main": 0, "threads": 0, "forward": 0}
def count(event, seconds, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        compiles["main" if threading.current_thread() is threading.main_thread() else "threads"] += 1
        compiles["forward"] += "forward_step" in kwargs.get("fun_name", "")
jax.monitoring.register_event_duration_secs_listener(count)
with LLM(sys.argv[1], dtype="float32", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
         compile_buckets="all") as llm:
    text = llm.generate(["ab"], use_tqdm=False)[0].outputs[0].text
print(json.dumps(compiles))
"""


def test_start_up_compiles_buckets_on_threads_and_the_runs_reuse_them(model_dir, tmp_path):
    """Start-up compiles every bucket ahead of time on worker threads; the warm-up runs then reuse those programs
    instead of compiling each a second time on the main thread. A fresh process (and an empty persistent cache),
    so nothing was compiled before."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", PRECOMPILE_PROBE, str(model_dir)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiles = json.loads(proc.stdout.strip().splitlines()[-1])
    shapes = pinned_shapes(StepBuckets.build(32, 8, -(-64 // 16)))
    assert compiles["threads"] >= len(shapes), compiles  # every shape's forward at least
    # the main thread compiles the cache allocation and such, never a step program of each shape
    assert compiles["main"] < len(shapes), compiles
    # each shape's forward program is built once: no two threads build the same one at the same time
    assert compiles["forward"] == len(shapes), compiles


def test_pinned_start_up_compiles_one_mixed_program_per_token_bucket():
    """An 8B server's buckets (2048 tokens, 256 requests): a step with a prefill pads its requests to the most its
    token bucket can hold, so start-up builds one program per token bucket besides the decode ones, and every
    mixed step (at most min(tokens, 256) requests) fits its shape."""
    buckets = StepBuckets.build(2048, 256, 512)
    shapes = pinned_shapes(buckets)
    mixed = [s for s in shapes if s.query_len > 1]
    assert len(shapes) == len(buckets.seqs) + len(buckets.tokens) == 14
    assert sorted(s.tokens for s in mixed) == list(buckets.tokens)
    assert all(s.seqs >= min(s.tokens, 256) for s in mixed)


def test_decode_tables_narrow_to_one_split_where_the_backend_has_one():
    """A backend whose decode merges its splits after a wide table (`one_split_positions`) gives a pinned runner a
    second decode width: the widest bucket within one split (no merge launch), beside the whole table; mixed steps
    and a backend without splits keep the whole table."""
    buckets = StepBuckets.build(2048, 256, 2048, one_split_blocks=2048 // 16)  # 32k positions, 2,048 a segment
    assert buckets.decode_blocks == (128, 2048)
    shapes = pinned_shapes(buckets)
    assert {s.blocks for s in shapes if s.query_len == 1} == {128, 2048}
    assert {s.blocks for s in shapes if s.query_len > 1} == {2048}
    assert len(shapes) == 2 * len(buckets.seqs) + len(buckets.tokens)
    assert StepBuckets.build(2048, 256, 2048, one_split_blocks=100).decode_blocks == (64, 2048)
    assert StepBuckets.build(2048, 256, 64, one_split_blocks=128).decode_blocks == (64,)  # the whole table fits
    assert StepBuckets.build(2048, 256, 2048).decode_blocks == (2048,)


def test_pinned_decode_steps_take_the_narrow_table_while_their_requests_fit(build_checkpoint, tiny_tokenizer_dir,
                                                                          monkeypatch):
    """With a backend that merges past 64 positions, decode steps whose requests fit 64 positions run on the narrow
    table, longer ones and prefills on the whole one; both widths compile at start-up, none after, and the greedy
    tokens are those of the lazily compiled engine (whose tables follow the longest request)."""
    from jengine.attention.backend import ReferenceBackend
    from jengine.runner.input_batch import InputBatch

    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "max_position_embeddings": 256})
    path = str(build_checkpoint(config, tokenizer_dir=tiny_tokenizer_dir)[0])
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 9)]
    params = SamplingParams(temperature=0, max_tokens=30)
    with LLM(path, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="lazy") as llm:
        lazy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(ReferenceBackend, "one_split_positions", lambda self, quantized: 64)
    widths = []
    real = InputBatch._table_width

    def recording(self, needed, longest):
        widths.append((needed, longest, real(self, needed, longest)))
        return widths[-1][2]

    monkeypatch.setattr(InputBatch, "_table_width", recording)
    with LLM(path, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
             compile_buckets="all") as llm:
        assert llm._core.runner.buckets.decode_blocks == (4, 16)
        after_start = num_compiled_shapes()
        pinned = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert num_compiled_shapes() == after_start, "a step compiled after warm-up"
    assert pinned == lazy
    decode = [(needed, width) for needed, longest, width in widths if longest == 1]
    assert {width for needed, width in decode if needed <= 4} == {4}
    assert {width for needed, width in decode if needed > 4} == {16}
    assert {width for _, longest, width in widths if longest > 1} == {16}
