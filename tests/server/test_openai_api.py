"""The OpenAI surface through the official `openai` client (sync, async, streaming) and httpx for the raw wire."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from jengine.tokenizer import Tokenizer
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, ServerHandle

THE = 316  # " the": one token of the tiny tokenizer, forced with logit_bias where a test needs known text
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(chat_model_dir)


def sse_payloads(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    text = response.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert text.endswith("\n\n") and all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e[len("data: "):] for e in events]


def test_models_list_and_retrieve(server: ServerHandle) -> None:
    client = server.client()
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN and models[0].owned_by == "jengine"
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found"


def test_health_and_version(server: ServerHandle) -> None:
    assert server.http.get("/health").status_code == 200
    version = server.http.get("/version").json()["version"]
    assert isinstance(version, str) and version


def test_completion(server: ServerHandle, tokenizer: Tokenizer) -> None:
    before = int(time.time())
    result = server.client().completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6,
                                                **GREEDY)
    assert result.id.startswith("cmpl-") and result.object == "text_completion" and result.model == MODEL_NAME
    assert result.system_fingerprint and before <= result.created <= time.time() + 1
    [choice] = result.choices
    assert choice.index == 0 and choice.finish_reason == "length" and isinstance(choice.text, str)
    prompt_tokens = len(tokenizer.encode("The quick brown fox"))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 6)
    assert result.usage.total_tokens == prompt_tokens + 6
    assert result.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_completion(server: ServerHandle, tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    result = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5,
                                                     **GREEDY)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    [choice] = result.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(tokenizer.encode_chat(messages)) and result.usage.completion_tokens == 5


def test_chat_stream_with_usage_matches_non_streaming(server: ServerHandle) -> None:
    client = server.client()
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, n=2,
                  **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {c.index: c.message.content for c in whole.choices} and finishes == {0: "length", 1: "length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 16
    assert (usage.prompt_tokens, usage.total_tokens) == (whole.usage.prompt_tokens, whole.usage.total_tokens)


def test_completion_stream_raw_sse(server: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    whole = server.http.post("/v1/completions", json={**body, "stream": False}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_async_client_streams_and_calls(server: ServerHandle) -> None:
    async def run() -> tuple[list[str], list[str]]:
        client = server.async_client()
        prompts = [f"Async prompt {i}" for i in range(4)]

        async def streamed(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, stream=True,
                                                     **GREEDY)
            return "".join([chunk.choices[0].text async for chunk in stream])

        async def whole(prompt: str) -> str:
            return (await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, **GREEDY)
                    ).choices[0].text

        return (await asyncio.gather(*map(streamed, prompts)), await asyncio.gather(*map(whole, prompts)))

    streamed, whole = asyncio.run(run())
    assert streamed == whole


def test_max_tokens_omitted(server: ServerHandle) -> None:
    """As vLLM's server: /v1/completions generates 16 tokens (OpenAI's legacy default), chat the rest of the
    context."""
    client, prompt = server.client(), [THE] * 200
    result = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 16 and result.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "the " * 100}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"


def test_context_length_error_states_both_lengths(server: ServerHandle) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL_NAME, prompt=[THE] * 200, max_tokens=100)
    error = caught.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "200" in error["message"] and str(MAX_MODEL_LEN) in error["message"]


def test_a_long_token_prompt_is_one_prompt(server: ServerHandle) -> None:
    """A flat array of token ids is one prompt however long (the cap on prompts per batch does not apply): past
    max_model_len it is the context-length error."""
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL_NAME, prompt=[THE] * 1100, max_tokens=1)
    assert caught.value.body["code"] == "context_length_exceeded" and "1100" in caught.value.body["message"]


def test_a_returned_message_can_be_sent_back(server: ServerHandle) -> None:
    """The client's own response message, dumped with its null fields (refusal, tool_calls, audio, ...), is
    accepted in the next request's history; top_logprobs=0 without logprobs asks for nothing and is accepted."""
    client = server.client()
    first = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, **GREEDY)
    history = [{"role": "user", "content": "hi"}, first.choices[0].message.model_dump(),
               {"role": "user", "content": "more"}]
    assert any(value is None for value in history[1].values())
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=3, top_logprobs=0,
                                            **GREEDY)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens and second.choices[0].logprobs is None


def test_chat_template_options(server: ServerHandle, tokenizer: Tokenizer) -> None:
    """vLLM's continue_final_message (the reply continues a prefilled assistant message) and chat_template_kwargs
    (extra template variables), on chat completions and /tokenize alike; continuing a message while also opening a
    new turn is a 400."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"enable_thinking": False}}
    expected = tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(expected, skip_special_tokens=False).endswith("assistant\nThe answer is")
    tokens = server.http.post("/tokenize", json={"messages": messages, **options}).json()["tokens"]
    assert tokens == expected
    chat = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                                   extra_body={**GREEDY["extra_body"], **options}, temperature=0)
    assert chat.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                                extra_body={"continue_final_message": True})


def test_vllm_request_id_and_default_valued_extras(server: ServerHandle) -> None:
    """vLLM's request_id names the response; extras set to the value this server always uses are accepted."""
    client = server.client()
    completion = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={
        "request_id": "eval-7", "best_of": 1, "add_special_tokens": True, "return_tokens_as_token_ids": False})
    assert completion.id == "cmpl-eval-7"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body={"request_id": "c-1", "add_special_tokens": False,
                                                                    "echo": False})
    assert chat.id == "chatcmpl-c-1"


def test_completion_logprobs_with_echo(server: ServerHandle, tokenizer: Tokenizer) -> None:
    prompt = "The weather is nice"
    result = server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, logprobs=3,
                                                echo=True, **GREEDY)
    choice, num_prompt = result.choices[0], len(tokenizer.encode(prompt))
    logprobs = choice.logprobs
    assert choice.text.startswith(prompt) and len(logprobs.tokens) == num_prompt + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs[1:])  # the 3 most likely and the chosen one
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    for token, logprob, top in zip(logprobs.tokens[num_prompt:], logprobs.token_logprobs[num_prompt:],
                                   logprobs.top_logprobs[num_prompt:]):
        assert top[token] == logprob and logprob == max(top.values())  # greedy: the chosen token is the top one


def test_echo_with_zero_max_tokens_scores_the_prompt(server: ServerHandle, tokenizer: Tokenizer) -> None:
    """vLLM's prompt scoring (log-likelihood evaluation): echo with max_tokens 0 returns the prompt and its
    logprobs and generates nothing, streamed or not; the prompt rows equal those of an echo that generates."""
    client, prompt = server.client(), "The weather is nice"
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice, num_prompt = scored.choices[0], len(tokenizer.encode(prompt))
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == num_prompt and choice.logprobs.token_logprobs[0] is None
    generating = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    assert generating.choices[0].logprobs.token_logprobs[:num_prompt] == choice.logprobs.token_logprobs
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == \
        choice.logprobs.tokens
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0)


def test_streamed_echo_and_logprobs_match_non_streaming(server: ServerHandle) -> None:
    body = {"model": MODEL_NAME, "prompt": "Echo me", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 2}
    whole = server.http.post("/v1/completions", json=body).json()["choices"][0]
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(p)["choices"][0] for p in sse_payloads(response)[:-1]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key]


def test_chat_logprobs(server: ServerHandle) -> None:
    result = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True, top_logprobs=5,
        **GREEDY)
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 5 and item.bytes == list(item.token.encode())
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True) and item.logprob == values[0]  # greedy picks rank 1


def test_n_and_seed(server: ServerHandle) -> None:
    client = server.client()

    def sample(seed: int) -> list[str]:
        result = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, n=3,
                                           temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        assert [c.index for c in result.choices] == [0, 1, 2] and result.usage.completion_tokens == 24
        return [c.text for c in result.choices]

    first = sample(7)
    assert sample(7) == first and len(set(first)) > 1 and sample(8) != first


def test_stop_strings_stop_token_ids_and_min_tokens(server: ServerHandle) -> None:
    client = server.client()
    forced = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 6, "temperature": 0, "logit_bias": {str(THE): 100}}
    base = client.completions.create(**forced).choices[0]
    assert base.text == " the" * 6
    cut = client.completions.create(**forced, stop=["e t"]).choices[0]
    assert (cut.text, cut.finish_reason, cut.model_extra["stop_reason"]) == (" th", "stop", "e t")
    kept = client.completions.create(**forced, stop="e t", extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " the t"
    by_id = client.completions.create(**forced, extra_body={"stop_token_ids": [THE], "min_tokens": 2})
    choice = by_id.choices[0]
    assert by_id.usage.completion_tokens == 3 and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == THE and " the" not in choice.text


def test_vllm_sampling_extras(server: ServerHandle) -> None:
    client = server.client()
    kwargs = dict(model=MODEL_NAME, prompt="Sampling extras", max_tokens=6)
    greedy = client.completions.create(**kwargs, **GREEDY).choices[0].text
    top_k_1 = client.completions.create(**kwargs, temperature=1.0, extra_body={"top_k": 1, "ignore_eos": True})
    assert top_k_1.choices[0].text == greedy
    extras = {"min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True, "skip_special_tokens": False,
              "spaces_between_special_tokens": True, "prompt_logprobs": 2, "priority": 0}
    result = client.completions.create(**kwargs, temperature=0.5, presence_penalty=0.5, frequency_penalty=0.5,
                                       top_p=0.9, seed=1, user="someone", extra_body=extras)
    prompt_logprobs = result.choices[0].model_extra["prompt_logprobs"]
    assert result.usage.completion_tokens == 6 and prompt_logprobs[0] is None
    assert len(prompt_logprobs) == result.usage.prompt_tokens and all(2 <= len(p) <= 3 for p in prompt_logprobs[1:])
    # echo computes the prompt's logprobs with `logprobs` candidates; the prompt_logprobs field shows what it asked
    echoed = client.completions.create(**kwargs, echo=True, logprobs=4, temperature=0,
                                       extra_body={"prompt_logprobs": 1, "ignore_eos": True})
    ids = server.http.post("/tokenize", json={"prompt": "Sampling extras"}).json()["tokens"]
    shown = echoed.choices[0].model_extra["prompt_logprobs"]
    assert all(1 <= len(p) <= 2 and str(token) in p for p, token in zip(shown[1:], ids[1:]))
    tops = echoed.choices[0].logprobs.top_logprobs[1:len(ids)]  # keyed by text: byte tokens may share one
    assert max(len(top) for top in tops) > 2, "echo's rows keep logprobs=4 candidates"


def test_batch_of_prompts(server: ServerHandle, tokenizer: Tokenizer) -> None:
    client = server.client()
    prompts = ["First prompt", "Second prompt"]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, **GREEDY).choices[0].text
               for p in prompts]
    assert [c.text for c in batch.choices] == [singles[0]] * 2 + [singles[1]] * 2
    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, **GREEDY)
    assert [c.text for c in by_ids.choices] == singles and by_ids.usage.prompt_tokens == sum(map(len, ids))


def test_tokenize_and_detokenize(server: ServerHandle, tokenizer: Tokenizer) -> None:
    text = "Hello, world! 你好"
    result = server.http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text,
                                                       "return_token_strs": True}).json()
    assert result["tokens"] == tokenizer.encode(text) and result["count"] == len(result["tokens"])
    assert result["max_model_len"] == MAX_MODEL_LEN and len(result["token_strs"]) == result["count"]
    back = server.http.post("/detokenize", json={"tokens": result["tokens"]}).json()
    assert back == {"prompt": text}
    messages = [{"role": "user", "content": "Hi"}]
    chat = server.http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
