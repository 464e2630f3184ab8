"""EAGLE heads: a head that predicts the target exactly has every draft accepted (so the head's K/V, its carried
features and its chained steps line up with the target's positions), the speculation counters count its drafts,
EAGLE-3 reads the target layers its config names, and malformed heads are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jengine import LLM, SamplingParams
from jengine.errors import CheckpointError, ConfigError
from tests.conftest import COMMON
from tests.spec_decode.conftest import _head_config, _layer_tensors, build_eagle3_head, build_eagle_head, write_head


def build(model_dir, **engine_args) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=128, seed=0, **engine_args)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def copying_head(tmp_path_factory, copying_model):
    """For the copying model (its layers add nothing, its LM head maps a token's embedding to the token after
    it): an EAGLE head that passes the input token's embedding through (fc = [I | 0], the layer adds nothing), so
    the target's LM head on its output names the token after the input one, which is the target's own choice.
    Saved with its own copy of the embedding and `model.`-prefixed names, as some published heads are."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    d = COMMON["hidden_size"]
    tensors = {"fc.weight": np.concatenate([np.eye(d), np.zeros((d, d))], axis=1).astype(np.float32),
               **_layer_tensors("layers.0", rng, d)}
    tensors["layers.0.self_attn.o_proj.weight"][:] = 0
    tensors["layers.0.mlp.down_proj.weight"][:] = 0
    tensors["embed_tokens.weight"] = load_file(str(copying_model[0] / "model.safetensors"))[
        "model.embed_tokens.weight"]
    tensors = {"model." + name: value for name, value in tensors.items()}
    return write_head(tmp_path_factory.mktemp("copying_head"), _head_config("LlamaForCausalLM"), tensors)


def test_exact_head_has_every_draft_accepted(copying_model, copying_head):
    model_dir, cycle = copying_model
    prompts = [cycle * 2, cycle[3:] + cycle, cycle[:5]]
    plain = build(model_dir, max_num_seqs=4)
    expected = greedy(plain, prompts, max_tokens=24)
    assert plain._core.runner._model.capture is None, "without a head the step returns no hidden states"
    plain.shutdown()
    llm = build(model_dir, max_num_seqs=4, max_num_batched_tokens=16,  # chunked prompts: carries across chunks
                speculative_config={"method": "eagle", "model": str(copying_head), "num_speculative_tokens": 4})
    assert llm._core.runner._model.capture == ()  # the final hidden states
    assert greedy(llm, prompts, max_tokens=24) == expected
    counts = llm._core.scheduler.spec_counts
    assert counts.num_drafts > 0 and counts.num_draft_tokens >= 3 * counts.num_drafts
    assert counts.num_accepted_tokens == counts.num_draft_tokens, "an exact head's drafts are all accepted"
    assert counts.accepted_per_pos[0] == counts.num_drafts
    assert llm._core.kv_manager.num_free_blocks == llm._core.kv_manager.num_blocks
    llm.shutdown()


def test_eagle3_reads_the_layers_its_config_names(dense_target, tmp_path):
    """The step returns the inputs of the target layers the head's config names (or speculative_config's
    override), side by side in layer order; the output stays the plain engine's."""
    prompts = [list(range(5, 25)), list(range(40, 52))]
    plain = build(dense_target)
    expected = greedy(plain, prompts)
    plain.shutdown()
    head = build_eagle3_head(tmp_path / "head", seed=9, aux_layers=[2, 0, 1])
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2,
              "eagle_aux_hidden_state_layer_ids": [1, 2, 0]}
    llm = build(dense_target, speculative_config=config)
    assert llm._core.runner._model.capture == (0, 1, 2)
    assert greedy(llm, prompts) == expected
    assert llm._core.scheduler.spec_counts.num_draft_tokens > 0
    llm.shutdown()


def test_malformed_heads_are_refused(dense_target, eagle_heads, tmp_path):
    good = eagle_heads["eagle3", "dense"]
    config = json.loads((good / "config.json").read_text())
    bad = tmp_path / "deep"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    (bad / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="one decoder layer"):
        build(dense_target, speculative_config={"method": "eagle3", "model": str(bad), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        build(dense_target, speculative_config={"method": "eagle3", "model": str(good), "num_speculative_tokens": 2,
                                                "eagle_aux_hidden_state_layer_ids": [0, 1, 7]})
    with pytest.raises(CheckpointError, match="fc.weight"):  # an EAGLE-3 head read as EAGLE: fc is 3·d wide
        build(dense_target, speculative_config={"method": "eagle", "model": str(good), "num_speculative_tokens": 2})


# ------------------------------------------------------------------ an independent float64 reference of the heads
def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, theta=10000.0):
    half = x.shape[-1] // 2
    angles = positions[:, None] * theta ** (-np.arange(half) * 2 / x.shape[-1])
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _layer(t: dict, prefix: str, attention_input, residual):
    """The head's Llama layer over all entries so far (entry i at position i, causal); returns its outputs."""
    heads, kv_heads = COMMON["num_attention_heads"], COMMON["num_key_value_heads"]
    hd = COMMON["hidden_size"] // heads
    n = len(attention_input)
    positions = np.arange(n, dtype=np.float64)
    q = _rope((attention_input @ t[f"{prefix}.self_attn.q_proj.weight"].T).reshape(n, heads, hd), positions)
    k = _rope((attention_input @ t[f"{prefix}.self_attn.k_proj.weight"].T).reshape(n, kv_heads, hd), positions)
    v = (attention_input @ t[f"{prefix}.self_attn.v_proj.weight"].T).reshape(n, kv_heads, hd)
    k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = residual + np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ t[f"{prefix}.self_attn.o_proj.weight"].T
    h = _rms(x, t[f"{prefix}.post_attention_layernorm.weight"])
    gate, up = h @ t[f"{prefix}.mlp.gate_proj.weight"].T, h @ t[f"{prefix}.mlp.up_proj.weight"].T
    return x + (gate / (1 + np.exp(-gate)) * up) @ t[f"{prefix}.mlp.down_proj.weight"].T


def reference_drafts(kind: str, head_dir, target_dir, prompt: list[int], next_token: int, k: int) -> list[int]:
    """The head's k greedy drafts after `prompt` and the target's `next_token`, from HF's float64 hidden states."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    t = {name: value.astype(np.float64) if value.dtype == np.float32 else value
         for name, value in load_file(str(head_dir / "model.safetensors")).items()}
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64)
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    states = [s[0].numpy() for s in out.hidden_states]
    embed = target.model.embed_tokens.weight.detach().numpy()
    if kind == "eagle":
        features, lm_head = states[-1], target.lm_head.weight.detach().numpy()
    else:
        features = np.concatenate([states[i] for i in (0, 1, 2)], axis=-1) @ t["fc.weight"].T
        lm_head = t["lm_head.weight"]
    tokens = list(prompt[1:]) + [next_token]  # entry q pairs token q + 1 with the feature of q
    features, drafts = list(features), []
    for _ in range(k):
        e, f = embed[tokens], np.stack(features)
        if kind == "eagle":
            x = np.concatenate([e, f], -1) @ t["fc.weight"].T
            out_hidden = feedback = _layer(t, "layers.0", x, x)[-1]
        else:
            normed = _rms(f, t["midlayer.hidden_norm.weight"])
            x = np.concatenate([_rms(e, t["midlayer.input_layernorm.weight"]), normed], -1)
            feedback = _layer(t, "midlayer", x, f)[-1]
            out_hidden = _rms(feedback, t["norm.weight"])
        best = int(np.argmax(lm_head @ out_hidden))
        token = best if kind == "eagle" else best + int(t["d2t"][best])
        drafts.append(token)
        tokens.append(token)
        features.append(feedback)
    return drafts


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_first_proposal_matches_a_float64_reference(kind, dense_target, tmp_path):
    """The engine's first drafts after a (chunked) prefill are the reference head's: the features, the head's
    K/V over the prompt, the carried feature and the chained recurrence are the published models' math. The
    head's weights are large enough that its attention over the prompt's entries decides the drafts."""
    build_head = build_eagle_head if kind == "eagle" else build_eagle3_head
    head = build_head(tmp_path / "head", seed=11, scale=0.5)
    prompt = np.random.default_rng(1).integers(3, COMMON["vocab_size"], 37).tolist()
    llm = build(dense_target, max_num_batched_tokens=16, max_num_seqs=2,
                speculative_config={"method": kind, "model": str(head), "num_speculative_tokens": 3})
    proposer, proposals = llm._core.runner.proposer, []
    propose = proposer.propose
    proposer.propose = lambda batch, rows: proposals.append(propose(batch, rows)) or proposals[-1]
    tokens = greedy(llm, [prompt], max_tokens=2)[0]
    llm.shutdown()
    assert proposals[0][0] == reference_drafts(kind, head, dense_target, prompt, tokens[0], 3)
