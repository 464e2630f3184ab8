"""The model's generation_config.json sampling defaults, as vLLM's --generation-config auto: they fill what a request
leaves unset (offline and on the server, over gRPC too), a request's own values win, and "vllm" turns them off."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import LlamaConfig

from jengine import LLM, SamplingParams
from jengine.clients.protocol import ModelInfo
from jengine.errors import CheckpointError, ConfigError
from jengine.sampling.defaults import load_sampling_defaults
from server.grpc_convert import model_info_from_proto, model_info_to_proto
from server.openai.protocol import parse_chat, parse_completion
from tests.conftest import COMMON

QWEN_STYLE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
              "max_new_tokens": 4, "eos_token_id": 2}


def test_defaults_read_from_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_STYLE))
    assert load_sampling_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                "repetition_penalty": 1.05, "max_tokens": 4}
    assert load_sampling_defaults(tmp_path, "vllm") == {}
    assert load_sampling_defaults(tmp_path / "missing") == {}
    assert load_sampling_defaults("/nowhere", str(tmp_path))["top_k"] == 20
    with pytest.raises(ConfigError, match="no generation_config.json"):
        load_sampling_defaults(tmp_path, str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 2.5}))
    with pytest.raises(CheckpointError, match="top_k must be an integer"):
        load_sampling_defaults(tmp_path)


def test_server_requests_take_the_defaults_they_leave_unset():
    info = ModelInfo("m", "/m", 256, 384, 20, {"temperature": 0.7, "top_k": 20, "max_tokens": 4})
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "top_k": 5}, info).params
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.7, 5, None)  # max_tokens: the endpoint's own
    completion = parse_completion({"prompt": "hi", "temperature": 0}, info).params
    assert (completion.temperature, completion.top_k, completion.max_tokens) == (0, 20, 16)
    assert model_info_from_proto(model_info_to_proto(info, _FakeTokenizer())) == info


class _FakeTokenizer:
    vocab_size, eos_token_ids, all_special_ids, has_chat_template = 384, {2}, [1, 2], True
    bos_token_id, eos_token_id, pad_token_id = 1, 2, None


@pytest.fixture(scope="module")
def model_dirs(build_checkpoint, tiny_tokenizer_dir, tmp_path_factory):
    """The same tiny model twice: with greedy-in-effect defaults (top_k 1, 4 tokens), and without any."""
    plain, _ = build_checkpoint(LlamaConfig(**COMMON), tokenizer_dir=tiny_tokenizer_dir)
    tuned = tmp_path_factory.mktemp("tuned")
    shutil.copytree(plain, tuned, dirs_exist_ok=True)
    (tuned / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 4, "eos_token_id": 2}))
    return plain, tuned


def test_offline_generation_uses_the_models_defaults(model_dirs):
    plain, tuned = model_dirs
    prompts = ["Hello there", "The weather"]
    with LLM(str(plain), max_model_len=64, dtype="float32") as llm:
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4),
                                                                 use_tqdm=False)]
    with LLM(str(tuned), max_model_len=64, dtype="float32") as llm:
        assert llm.get_default_sampling_params().top_k == 1
        outputs = llm.generate(prompts, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == greedy  # top_k 1 samples the argmax; 4 tokens
        assert len(llm.generate(prompts[0], SamplingParams(max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids) == 6
    with LLM(str(tuned), max_model_len=64, dtype="float32", generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
