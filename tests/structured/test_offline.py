"""Offline structured output (`SamplingParams(structured_outputs=...)`): valid outputs with random weights, the same
tokens pipelined and serial, masks filled beside the core thread from the right tokens, n choices each with its own
matcher, and the bitmask applied as a float64 reference."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import jax.numpy as jnp
import jsonschema
import llguidance.numpy
import numpy as np
import pytest
from transformers import LlamaConfig

import jengine
from jengine import LLM, SamplingParams, StructuredOutputsParams
from jengine.errors import InvalidRequestError
from jengine.sampling import params as params_module
from jengine.structured.device import apply_token_mask
from jengine.structured import masks as masks_module
from jengine.structured.masks import MaskFiller
from tests.conftest import COMMON

SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": -3,
                                                                             "maximum": 3}},
          "required": ["k", "v"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(build_checkpoint, tiny_tokenizer_dir):
    return build_checkpoint(LlamaConfig(**{**COMMON, "max_position_embeddings": 256}),
                            tokenizer_dir=tiny_tokenizer_dir)[0]


def _outputs(model_dir, params: list[SamplingParams], **engine_args) -> list[tuple[list[int], str, str]]:
    with LLM(str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4, **engine_args) as llm:
        outs = llm.generate(["the", "a b", "c", "dd", "e"], params, use_tqdm=False)
    return [(list(c.token_ids), c.text, c.finish_reason) for o in outs for c in o.outputs]


def test_constrained_rows_validate_and_pipelining_changes_nothing(model_dir) -> None:
    """Constrained rows (json, regex, n=2 choice) beside free ones, more requests than rows: every constrained output
    is valid, and pipelined (masks filled while the forward runs) equals serial token for token."""
    json_params = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_outputs=json_params),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,4}x")),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["up", "down"])),
              SamplingParams(temperature=1.0, seed=4, max_tokens=8)]
    pipelined = _outputs(model_dir, params, async_scheduling=True)
    assert pipelined == _outputs(model_dir, params, async_scheduling=False)
    (_, first, reason), _, (_, regex, _), (_, up, _), (_, down, _), _ = pipelined
    assert reason == "stop"
    jsonschema.validate(json.loads(first), SCHEMA)
    assert re.fullmatch(r"[0-9]{2,4}x", regex) and {up, down} <= {"up", "down"}


def test_matchers_advance_alike_in_llguidance_pool_and_one_by_one(model_dir, monkeypatch) -> None:
    """Many CPUs: a step's one-token advances go to llguidance's pool in one call; the outputs are the ones of the
    matchers fed one by one (as on a host of few CPUs), and still valid."""
    json_params = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=json_params)
              for seed in range(3)] + [SamplingParams(temperature=1.0, seed=9, max_tokens=12,
                                                      structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,4}x")),
               SamplingParams(temperature=1.0, seed=5, max_tokens=8)]  # a free row beside them
    monkeypatch.setattr(masks_module, "PARALLEL_ADVANCE_THREADS", 10**6)
    one_by_one = _outputs(model_dir, params)
    monkeypatch.setattr(masks_module, "PARALLEL_ADVANCE_THREADS", 1)
    pooled = _outputs(model_dir, params)
    assert pooled == one_by_one
    for _, text, reason in pooled[:3]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(r"[0-9]{2,4}x", pooled[3][1])


def test_exports_and_errors() -> None:
    assert jengine.StructuredOutputsParams is StructuredOutputsParams is params_module.StructuredOutputsParams
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["a"])).validate(100)
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(json="{not json")
    assert caught.value.param == "json"


def test_invalid_schema_is_refused_before_admission(model_dir) -> None:
    with LLM(str(model_dir), dtype="float32", max_model_len=128) as llm:
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object",
                                                                             "properties": {"a": {"type": "strin"}}}))
        with pytest.raises(InvalidRequestError, match="strin") as caught:
            llm.generate(["x"], bad, use_tqdm=False)
        assert caught.value.param == "json_schema"


def test_token_mask_matches_a_numpy_reference() -> None:
    """Bit t % 32 of word t // 32 allows token t; tokens past the words (padded vocabulary rows) are banned."""
    rng = np.random.default_rng(0)
    vocab, words = 100, 3  # 96 bits: tokens 96..99 have no bit
    logits = rng.standard_normal((4, vocab))
    mask = rng.integers(-(2**31), 2**31, size=(4, words), dtype=np.int64).astype(np.int32)
    mask[0] = -1  # a free row: every bit set
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(4, -1).astype(bool)
    expected = np.where(np.pad(bits, ((0, 0), (0, vocab - 96))), logits, -np.inf)
    got = np.asarray(apply_token_mask(jnp.asarray(logits, jnp.float32), jnp.asarray(mask)), np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert np.isinf(got[0, 96:]).all() and np.isfinite(got[0, :96]).all()


def test_the_core_imports_no_grammar_library() -> None:
    probe = "import sys, jengine.engine.core, jengine.runner.step; print('llguidance' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_each_mask_is_filled_beside_the_core_thread_from_every_earlier_token(model_dir, monkeypatch) -> None:
    """Pipelined, each step's masks are filled on the mask thread (the core thread goes on meanwhile), from matchers
    that have consumed exactly the request's tokens so far; each sampled token is one its mask allowed."""
    fed: dict[str, int] = {}  # tokens fed to each request's matcher
    pending: dict[str, np.ndarray] = {}  # per request, the mask its next token is sampled under
    consumed_vs_known: list[tuple[int, int]] = []
    fill_threads: set[str] = set()
    allowed: list[bool] = []
    real_advance, real_fill_later = MaskFiller.advance, MaskFiller.fill_later
    real_par = llguidance.numpy.fill_next_token_bitmask_par

    def counting_advance(self, updates):
        for request, token_ids in updates:
            mask = pending.pop(request.request_id, None)
            if mask is not None:  # the token this step sampled, against the mask it was sampled under
                allowed.append(bool((int(mask[token_ids[0] // 32]) >> (token_ids[0] % 32)) & 1))
            fed[request.request_id] = fed.get(request.request_id, 0) + len(token_ids)
        real_advance(self, updates)

    def recording_fill_later(self, requests):
        constrained = [r for r in requests if r is not None and r.grammar is not None]
        consumed_vs_known.extend((fed.get(r.request_id, 0), len(r.output_token_ids)) for r in constrained)
        future = real_fill_later(self, requests)

        def keep(done):
            for row, words in zip(*done.result()):
                pending[requests[row].request_id] = words

        future.add_done_callback(keep)
        return future

    def recording_par(*args):
        fill_threads.add(threading.current_thread().name)
        return real_par(*args)

    monkeypatch.setattr(MaskFiller, "advance", counting_advance)
    monkeypatch.setattr(MaskFiller, "fill_later", recording_fill_later)
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", recording_par)
    params = [SamplingParams(temperature=1.0, seed=7, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=1.0, seed=8, max_tokens=10)]
    with LLM(str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4, async_scheduling=True) as llm:
        out = llm.generate(["the", "a b"], params, use_tqdm=False)
    jsonschema.validate(json.loads(out[0].outputs[0].text), SCHEMA)
    assert len(allowed) == len(out[0].outputs[0].token_ids) and all(allowed)
    assert fill_threads == {"jengine-masks_0"}
    assert consumed_vs_known and all(consumed == known for consumed, known in consumed_vs_known)
