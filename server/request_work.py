"""CPU-heavy request work, off the event loop and with bounded concurrency.

Parsing a 4 MB body, tokenizing it, rendering a chat template over 100k messages, decoding 2M ids, building and
encoding a 20 MB response: each takes seconds, and on the event loop it would stall every stream and `/health` for
that long. The servers run such work here, on a small thread pool owned by the server (tokenizers release the GIL
while encoding; pure Python work hands it back every few milliseconds), so the loop keeps answering. The pool bounds
how much of it runs at once; what waits for a thread holds no engine slot.

Prompts reach the engine already tokenized and bounded by the context (`prepare_prompts`), so the engine's own checks
stay cheap on the loop; they are still done there, as for every other caller.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from jengine.clients.protocol import ModelInfo
from jengine.errors import InvalidRequestError
from jengine.front.input_processor import check_prompt_fits
from jengine.sampling.params import SamplingParams
from jengine.tokenizer import Tokenizer
from jengine.tokenizer.chat import chat_text

T = TypeVar("T")

MAX_WORKERS = 4  # threads for request work; more would only queue on the GIL
JSON_PIECES_PER_JOIN = 16_384
MAX_PROMPT_LOGPROB_ENTRIES = 131_072
"""Cap on n × prompt tokens × (prompt_logprobs + 1), summed over a request's prompts: the logprob entries its response
holds (each about 70 bytes of JSON). vLLM caps prompt_logprobs at 20; n fans that out again, which without a bound made
one request of 16 × 1,000 tokens × 21 a 23 MB, 40 s response."""


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


class RequestWork:
    """The pool a server's handlers hand heavy work to; `close` when the server stops."""

    def __init__(self, workers: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="request-work")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a pool thread; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def encode_json(payload: Any) -> bytes:
    """`payload` as compact UTF-8 JSON, by the json module's pure-Python encoder: it yields piece by piece, so the
    thread running it hands the GIL back every few milliseconds, where the C encoder holds it for the whole call
    (a quarter of a second for 2M token ids, all of it a stall of the event loop)."""
    encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    pieces: list[str] = []
    joined: list[bytes] = []
    for piece in encoder.iterencode(payload):
        pieces.append(piece)
        if len(pieces) == JSON_PIECES_PER_JOIN:  # one join of millions of pieces would hold the GIL for long too
            joined.append("".join(pieces).encode("utf-8"))
            pieces.clear()
    joined.append("".join(pieces).encode("utf-8"))
    return b"".join(joined)


def prepare_prompts(tokenizer: Tokenizer, info: ModelInfo, prompts: Sequence[Any], params: SamplingParams
                    ) -> list[Any]:
    """Each prompt as `{"prompt": text (when there is one), "prompt_token_ids": ids}`, chats rendered; a prompt that
    cannot fit the context, or a request whose prompt logprobs would be unbounded work, is refused here. Run on the
    pool: this is the tokenizing. Over a remote engine's tokenizer the prompts pass as they are."""
    check_admissible(info, len(prompts), params.n)
    if not hasattr(tokenizer, "count_tokens"):  # a remote engine's tokenizer: that engine prepares them off its loop
        return list(prompts)
    prepared = [prepare_prompt(tokenizer, info, prompt) for prompt in prompts]
    check_prompt_logprob_work(params, [len(p["prompt_token_ids"]) for p in prepared])
    return prepared


def prepare_prompt(tokenizer: Tokenizer, info: ModelInfo, prompt: Any) -> dict[str, Any]:
    """One prompt (text, token ids, `{"prompt_token_ids"}` or a chat dict) tokenized as the engine would."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return {"prompt": prompt, "prompt_token_ids": _fitting_ids(tokenizer, info, prompt, True)}
    if isinstance(prompt, Mapping) and "messages" in prompt:
        options = {k: v for k, v in prompt.items() if k != "messages"}
        text = chat_text(tokenizer, prompt["messages"], options)  # the template holds BOS: no special tokens added
        return {"prompt": text, "prompt_token_ids": _fitting_ids(tokenizer, info, text, False)}
    prepared = dict(prompt) if isinstance(prompt, Mapping) else {"prompt_token_ids": prompt}
    check_prompt_fits(len(prepared.get("prompt_token_ids") or ()), info.max_model_len)
    return prepared


def _fitting_ids(tokenizer: Tokenizer, info: ModelInfo, text: str, add_special_tokens: bool) -> list[int]:
    count, ids = tokenizer.count_tokens(text, info.max_model_len, add_special_tokens)
    check_prompt_fits(count, info.max_model_len)
    assert ids is not None  # a count under the limit comes with its ids
    return ids


def check_admissible(info: ModelInfo, num_prompts: int, n: int) -> None:
    """A request needing more engine slots than the engine has could never be admitted: a 429 would have clients
    retry forever, so it is a 400, before any slot is taken."""
    needed = num_prompts * n
    if info.max_in_flight and needed > info.max_in_flight:
        raise InvalidRequestError(
            f"{num_prompts} prompt(s) × n={n} need {needed} sequences at once, more than this engine ever holds "
            f"({info.max_in_flight} running or queued): this request can never be admitted; split it",
            param="n" if num_prompts == 1 else "prompt")


def check_prompt_logprob_work(params: SamplingParams, prompt_lens: Sequence[int]) -> None:
    """Refuse n × prompt tokens × (prompt_logprobs + 1) over MAX_PROMPT_LOGPROB_ENTRIES, naming the fields."""
    if params.prompt_logprobs is None:
        return
    entries = params.n * sum(prompt_lens) * (params.prompt_logprobs + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise InvalidRequestError(
            f"n × prompt tokens × (prompt_logprobs + 1) is {params.n} × {sum(prompt_lens)} × "
            f"{params.prompt_logprobs + 1} = {entries}, over this server's limit of {MAX_PROMPT_LOGPROB_ENTRIES} "
            f"(echo with logprobs asks for prompt logprobs too): lower n, prompt_logprobs or logprobs, or split the "
            f"prompt", param="prompt_logprobs")
