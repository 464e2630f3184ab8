"""Tokenizer loading, encode/decode, special ids, and sandboxed chat templates."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from jengine.errors import CheckpointError, ConfigError, InvalidRequestError
from jengine.tokenizer import CHATML_TEMPLATE, NoChatTemplateError, Tokenizer

MULTILINGUAL = "Hello, world! 你好，世界。日本語のテキスト。한국어 🙂🚀👍🏽 Crème brûlée, naïve Zürich 龘 𝔘"

TWO_TURNS = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! 你好"},
    {"role": "user", "content": "Tell me a joke"},
]
TWO_TURNS_CHATML = (
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello! 你好<|im_end|>\n"
    "<|im_start|>user\nTell me a joke<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _copy_without_template(src: Path, dst: Path) -> Path:
    """A copy of a tokenizer directory with the chat template removed from tokenizer_config.json."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    """The same HF tokenizer under another template, for sandbox tests."""
    return Tokenizer(tokenizer.hf_tokenizer, chat_template=template)


# --- encode / decode -----------------------------------------------------------------------------------------------


def test_round_trip_multilingual(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MULTILINGUAL)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids) == MULTILINGUAL
    assert tokenizer.encode(MULTILINGUAL, add_special_tokens=False) == ids[1:]


def test_skip_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s><|im_start|>user\nhi<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_special_ids_and_vocab(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, None)
    assert tokenizer.vocab_size == 512
    assert set(tokenizer.all_special_ids) == {0, 1, 2, *tokenizer.encode("<|im_start|><|im_end|>", False)}
    assert tokenizer.eos_token_ids == {2}
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<s>", "</s>"]


@pytest.mark.parametrize(("eos", "expected"), [(7, {2, 7}), ([2, 9, 11], {2, 9, 11})])
def test_eos_ids_include_generation_config(tiny_dirs: dict[str, Path], tmp_path: Path, eos, expected) -> None:
    model_dir = shutil.copytree(tiny_dirs["bytelevel"], tmp_path / "model")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert Tokenizer.from_pretrained(model_dir).eos_token_ids == expected


def test_missing_directory_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")


def test_directory_without_tokenizer_files_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no tokenizer"):
        Tokenizer.from_pretrained(tmp_path)


def test_corrupt_tokenizer_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        Tokenizer.from_pretrained(tmp_path)


# --- chat templates ------------------------------------------------------------------------------------------------


def test_chatml_two_turns_with_generation_prompt(tokenizer: Tokenizer) -> None:
    assert tokenizer.has_chat_template
    assert tokenizer.apply_chat_template(TWO_TURNS) == TWO_TURNS_CHATML
    without_prompt = tokenizer.apply_chat_template(TWO_TURNS, add_generation_prompt=False)
    assert without_prompt == TWO_TURNS_CHATML.removesuffix("<|im_start|>assistant\n")


def test_encode_chat_adds_no_second_bos(tokenizer: Tokenizer) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ids = _with_template(tokenizer, template).encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>hi"


def test_no_template_raises_no_chat_template_error(no_template_dir: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(no_template_dir)
    assert not tokenizer.has_chat_template
    with pytest.raises(NoChatTemplateError, match="--chat-template") as info:
        tokenizer.apply_chat_template(TWO_TURNS)
    assert isinstance(info.value, InvalidRequestError)
    with pytest.raises(NoChatTemplateError):
        tokenizer.encode_chat(TWO_TURNS)


def test_chat_template_argument_as_file_and_as_text(no_template_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML_TEMPLATE)
    from_file = Tokenizer.from_pretrained(no_template_dir, chat_template=str(path))
    from_text = Tokenizer.from_pretrained(no_template_dir, chat_template=CHATML_TEMPLATE)
    assert from_file.apply_chat_template(TWO_TURNS) == TWO_TURNS_CHATML
    assert from_text.apply_chat_template(TWO_TURNS) == TWO_TURNS_CHATML
    long_text = CHATML_TEMPLATE + "{# " + "x" * 400 + " #}"  # too long to be a file name
    assert Tokenizer.from_pretrained(no_template_dir, chat_template=long_text).apply_chat_template(TWO_TURNS) == (
        TWO_TURNS_CHATML
    )


def test_chat_template_argument_overrides_the_model(tiny_dirs: dict[str, Path]) -> None:
    tokenizer = Tokenizer.from_pretrained(tiny_dirs["bytelevel"], chat_template="{{ messages | length }}!")
    assert tokenizer.apply_chat_template(TWO_TURNS) == "3!"


def test_chat_template_argument_errors(no_template_dir: Path) -> None:
    with pytest.raises(ConfigError, match="neither an existing file"):
        Tokenizer.from_pretrained(no_template_dir, chat_template="/no/such/template.jinja")
    with pytest.raises(ConfigError, match="not valid Jinja"):
        Tokenizer.from_pretrained(no_template_dir, chat_template="{% for m in messages %}")


def test_template_from_jinja_file_and_named_list(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = _copy_without_template(tiny_dirs["bytelevel"], tmp_path / "model")
    (model_dir / "chat_template.jinja").write_text("from file")
    assert Tokenizer.from_pretrained(model_dir).apply_chat_template([]) == "from file"
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(model_dir).apply_chat_template([]) == "default"


def test_template_variables_and_helpers(tokenizer: Tokenizer) -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ enable_thinking }}|"
        "{{ {'b': 'ü', 'a': [1, 2]} | tojson(sort_keys=True) }}|{{ [1] | tojson(indent=2) }}|"
        "{{ strftime_now('%Y') }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    rendered = _with_template(tokenizer, template).apply_chat_template(
        TWO_TURNS, tools=[{"name": "f", "description": "<é>"}], enable_thinking=False
    )
    year = str(datetime.now().year)
    expected = '<s>|</s>|[{"name": "f", "description": "<é>"}]|False|{"a": [1, 2], "b": "ü"}|[\n  1\n]|'
    assert rendered == expected + year + "|Hi there"


def test_raise_exception_becomes_invalid_request(tokenizer: Tokenizer) -> None:
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System message first!') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="^System message first!$"):
        _with_template(tokenizer, template).apply_chat_template(TWO_TURNS)


def test_render_failure_is_a_short_invalid_request(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="failed to render") as info:
        _with_template(tokenizer, "{{ messages[0]['content'] + 1 }}").apply_chat_template(TWO_TURNS)
    assert "\n" not in str(info.value) and "/" not in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ strftime_now.__globals__['__builtins__'] }}",
        "{{ messages.append(1) }}",
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(tokenizer: Tokenizer, template: str) -> None:
    with pytest.raises(InvalidRequestError, match="unsafe"):
        _with_template(tokenizer, template).apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_model_template_fails_per_request(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="not valid Jinja"):
        _with_template(tokenizer, "{% if %}").apply_chat_template(TWO_TURNS)


TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are helpful.{%- endif %}
{{- "\\n\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}
"""


@pytest.mark.parametrize("with_tools", [False, True])
def test_rendering_matches_transformers(tokenizer: Tokenizer, with_tools: bool) -> None:
    messages = [{"role": "system", "content": "Be brief. Ünïcödé ✓"}, *TWO_TURNS]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "東京"}}}]
    kwargs = {"tools": tools if with_tools else None, "enable_thinking": False}
    ours = _with_template(tokenizer, TOOLS_TEMPLATE).apply_chat_template(messages, **kwargs)
    hf = tokenizer.hf_tokenizer.apply_chat_template(
        messages, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours == hf
    assert ("東京" in ours) == with_tools and ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("final", ["The answer is", "The answer is  ", "多语言 🙂 \n"])
def test_continue_final_message_matches_transformers(tokenizer: Tokenizer, final: str) -> None:
    """The prompt ends inside the last message (a prefilled reply the model continues), as HF renders it."""
    messages = [*TWO_TURNS, {"role": "assistant", "content": final}]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    hf = tokenizer.hf_tokenizer.apply_chat_template(messages, chat_template=CHATML_TEMPLATE, tokenize=False,
                                                    add_generation_prompt=False, continue_final_message=True)
    assert ours == hf and ours.rstrip().endswith(final.strip()) and not ours.endswith("<|im_end|>\n")


def test_continue_final_message_errors(tokenizer: Tokenizer) -> None:
    messages = [*TWO_TURNS, {"role": "assistant", "content": "x"}]
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="final message with text"):
        tokenizer.apply_chat_template([*TWO_TURNS, {"role": "assistant", "content": "  "}],
                                      add_generation_prompt=False, continue_final_message=True)
    hidden = _with_template(tokenizer, "{% for m in messages %}{{ m.role }};{% endfor %}")
    with pytest.raises(InvalidRequestError, match="cannot be continued"):
        hidden.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)


def test_hf_tokenizer_calls_work_on_the_wrapper(tokenizer: Tokenizer) -> None:
    """Code written against vLLM's get_tokenizer() (an HF tokenizer) runs on jengine's: calls it does not define go
    to the HF tokenizer; apply_chat_template takes HF's tokenize= and conversation=."""
    hf = tokenizer.hf_tokenizer
    assert tokenizer("Hi there")["input_ids"] == hf("Hi there")["input_ids"] and len(tokenizer) == len(hf)
    assert tokenizer.tokenize("Hi there") == hf.tokenize("Hi there") and tokenizer.eos_token == hf.eos_token
    assert tokenizer.batch_decode([[1, 100]]) == hf.batch_decode([[1, 100]])
    assert tokenizer.apply_chat_template(TWO_TURNS, tokenize=True) == tokenizer.encode_chat(TWO_TURNS)
    assert tokenizer.apply_chat_template(conversation=TWO_TURNS) == TWO_TURNS_CHATML
    with pytest.raises(AttributeError):
        tokenizer.no_such_method  # noqa: B018
