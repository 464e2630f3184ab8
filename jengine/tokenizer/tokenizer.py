"""The engine's tokenizer: a HF tokenizer loaded from a local model directory, plus its chat template.

Text enters and leaves the engine here only. The HF tokenizer does the encoding; the chat template is found here (the
`--chat-template` argument, tokenizer_config.json, chat_template.jinja) and rendered by `jengine.tokenizer.chat`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from jengine.errors import CheckpointError, ConfigError, InvalidRequestError
from jengine.tokenizer import class_record
from jengine.tokenizer.byte_level import FastDecoding
from jengine.tokenizer.chat import ChatTemplate, Message, NoChatTemplateError, short

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json")
"""A directory holding none of these has no tokenizer (tokenizer_config.json alone names a class, not a vocabulary)."""

CHAT_TEMPLATE_FILE = "chat_template.jinja"
COUNT_PIECE_CHARS = 65_536  # `count_tokens` counts long texts in pieces of this many characters

__all__ = ["CHAT_TEMPLATE_FILE", "TOKENIZER_FILES", "NoChatTemplateError", "Tokenizer", "read_template_argument"]


class Tokenizer:
    """Encode, decode and chat-format text for one model; wraps a loaded HF tokenizer."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        """Wrap an already-loaded tokenizer; `extra_eos_token_ids` come from generation_config.json."""
        self._hf = hf_tokenizer
        # The Rust tokenizer behind a fast HF tokenizer decodes the same text without the Python wrapper's cost
        # (it matters: the detokenizer decodes every request's window every step).
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None) if getattr(hf_tokenizer, "is_fast", False) \
            else None
        self._chat = ChatTemplate(chat_template)
        self._extra_eos = frozenset(int(i) for i in extra_eos_token_ids)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, chat_template: str | None = None,
                        record_dir: str | Path | None = None) -> Tokenizer:
        """Load the tokenizer of a local model directory; `chat_template` (a file path or template text) overrides.
        `record_dir` (the engine passes its compilation cache): where the tokenizer class chosen for the directory is
        remembered, so a restart skips `AutoTokenizer`'s PyTorch import (`class_record`)."""
        path = Path(model_dir)
        hf = _load_hf_tokenizer(path, None if record_dir is None else Path(record_dir))
        template = _resolve_chat_template(path, chat_template)
        tokenizer = cls(hf, chat_template=template, extra_eos_token_ids=_generation_eos_ids(path))
        tokenizer._check_template(explicit=chat_template is not None)
        return tokenizer

    @staticmethod
    def check_files(model_dir: str | Path) -> None:
        """Raises CheckpointError, naming what is missing, unless the directory has tokenizer files: the quick check
        a caller that loads the tokenizer in the background runs first."""
        _check_tokenizer_files(Path(model_dir))

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped HF tokenizer, for the rare caller that needs more than this class offers."""
        return self._hf

    def __getattr__(self, name: str) -> Any:
        """What this class does not define comes from the HF tokenizer (`tokenize`, `batch_decode`, `get_vocab`,
        `eos_token`, ...), so code written against vLLM's `get_tokenizer()`, an HF tokenizer, runs unchanged."""
        if name.startswith("_"):  # private names (and those looked up before __init__ ran) never delegate
            raise AttributeError(name)
        return getattr(self._hf, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._hf(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the post-processor adds (BOS for Llama-style models)."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def count_tokens(self, text: str, limit: int, add_special_tokens: bool = True) -> tuple[int, list[int] | None]:
        """How many tokens `text` has, and their ids (`encode`'s) when fewer than `limit`, else None.

        A text far over the limit (a few MB pasted into a request) is counted piece by piece in the Rust batch path,
        which releases the GIL, without ever holding millions of ids (building or freeing them holds the GIL for
        a quarter of a second); that count is within a few tokens per piece, and is only trusted when it is over
        twice the limit. Anything nearer the limit is encoded exactly."""
        if self._backend is not None and len(text) > COUNT_PIECE_CHARS:
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            pieces = range(0, len(text), COUNT_PIECE_CHARS)
            count = sum(len(encode([text[i:i + COUNT_PIECE_CHARS]], add_special_tokens=False)[0]) for i in pieces)
            if count >= 2 * limit:
                return count, None
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return len(ids), ids if len(ids) < limit else None

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Text of `ids`, never with HF's clean-up of spaces, so whole and streamed decodes agree byte for byte.

        `spaces_between_special_tokens` is honoured by the Python tokenizers that implement it; the Rust-backed ones
        ignore it, as in HF.
        """
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )

    def decoder(self, skip_special_tokens: bool = True, *, spaces_between_special_tokens: bool = True
                ) -> Callable[[list[int]], str]:
        """`decode` of a list with these options bound, for callers decoding every step (the detokenizer): a byte
        table for byte-level BPE, else the Rust decode itself, without `decode`'s Python layers."""
        if self._backend is None:
            return partial(self.decode, skip_special_tokens=skip_special_tokens,
                           spaces_between_special_tokens=spaces_between_special_tokens)
        return self._fast_decoding.decoder(skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of `ids` (byte-level or "▁" forms, not text); for logprobs output."""
        return list(self._hf.convert_ids_to_tokens(list(ids)))

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own end-of-sequence id."""
        return self._hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, or None where the model has none."""
        return self._hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        """The padding id, or None (many causal models have none)."""
        return self._hf.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (`len` of the HF tokenizer)."""
        return len(self._hf)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named and extra special tokens."""
        return list(self._hf.all_special_ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation: the tokenizer's EOS plus generation_config.json's (e.g. Llama-3's eot)."""
        own = {self.eos_token_id} if self.eos_token_id is not None else set()
        return frozenset(own | self._extra_eos)

    @property
    def chat_template(self) -> str | None:
        """The chat template source in use, or None."""
        return self._chat.source

    @property
    def has_chat_template(self) -> bool:
        """Whether chat requests can be formatted for this model."""
        return self._chat.source is not None

    def apply_chat_template(
        self,
        messages: Sequence[Message] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tokenize: bool = False,
        conversation: Sequence[Message] | None = None,
        **template_kwargs: Any,
    ) -> Any:
        """Render the chat template to a prompt string (its token ids with `tokenize=True`), as HF's call does, in
        the sandbox of `jengine.tokenizer.chat`; errors become InvalidRequestError. `conversation` is HF's name for
        `messages`; `template_kwargs` are extra template variables (e.g. Qwen3's `enable_thinking`);
        `continue_final_message` (it excludes `add_generation_prompt`) ends the prompt inside the last message."""
        messages = conversation if messages is None else messages
        if messages is None:
            raise InvalidRequestError("apply_chat_template needs the messages", param="messages")
        if "return_dict" in template_kwargs or "return_tensors" in template_kwargs:
            raise InvalidRequestError("return_dict and return_tensors are HF tokenizer options: use "
                                      "tokenizer.hf_tokenizer.apply_chat_template for them", param="messages")
        if tokenize:
            return self.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, tools=tools, **template_kwargs)
        return self._chat.render(messages, {**self._special_token_strings(), **template_kwargs}, tools=tools,
                                 add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message)

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat; no special tokens are added because the template already holds BOS."""
        prompt = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, **template_kwargs
        )
        return self.encode(prompt, add_special_tokens=False)

    @cached_property
    def _fast_decoding(self) -> FastDecoding:
        """Built on first use: a byte-level table takes a pass over the vocabulary."""
        return FastDecoding(self._backend)

    def _check_template(self, *, explicit: bool) -> None:
        """Compile at load: a broken --chat-template stops start-up; a broken model template is logged and refused."""
        exc = self._chat.compile_errors()
        if exc is not None:
            if explicit:
                raise ConfigError(f"--chat-template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc
            logger.warning("the model's chat template is not valid Jinja; chat requests will fail: %s", exc.message)

    def _special_token_strings(self) -> dict[str, str]:
        """Special tokens as template variables; absent ones stay undefined (render as ""), never the text "None"."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        values = {name: getattr(self._hf, name, None) for name in names}
        return {name: str(value) for name, value in values.items() if value is not None}


# --- loading -----------------------------------------------------------------------------------------------------


def _load_hf_tokenizer(model_dir: Path, record_dir: Path | None = None) -> Any:
    """Load with transformers (imported here: importing jengine must stay light), local files only, no remote code.
    With `record_dir`, the class `AutoTokenizer` chose for this directory before is loaded directly
    (`class_record`); the first load records it."""
    _check_tokenizer_files(model_dir)
    # Serving needs only transformers' tokenizers: its advice that PyTorch is missing is noise at every start.
    logging.getLogger("transformers").addFilter(_drop_no_torch_advice)
    import transformers

    key = None if record_dir is None else class_record.directory_key(model_dir, transformers.__version__)
    known = None if key is None else class_record.recorded_class(record_dir, key)
    try:
        if known is not None:
            return known.from_pretrained(str(model_dir), local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(model_dir), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:  # transformers raises many types here; all mean "this checkpoint is unusable"
        raise CheckpointError(f"cannot load the tokenizer in {model_dir}: {short(exc)}") from exc
    if key is not None:
        class_record.record_class(record_dir, key, tokenizer)
    return tokenizer


def _drop_no_torch_advice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("PyTorch was not found")


def _check_tokenizer_files(model_dir: Path) -> None:
    """Fail with a message that names what is missing, before transformers tries the hub or guesses."""
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist or is not a directory")
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        expected = ", ".join(TOKENIZER_FILES)
        raise CheckpointError(f"no tokenizer in {model_dir}: expected one of {expected}")


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from a checkpoint file, None if the file is absent."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {short(exc)}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _generation_eos_ids(model_dir: Path) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list), which may name ids the tokenizer does not."""
    config = _read_json(model_dir / "generation_config.json") or {}
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"generation_config.json in {model_dir} has a non-integer eos_token_id: {eos!r}")
    return ids


# --- chat templates ------------------------------------------------------------------------------------------------


def _resolve_chat_template(model_dir: Path, override: str | None) -> str | None:
    """The --chat-template argument, else tokenizer_config.json's template, else chat_template.jinja (HF 5)."""
    if override is not None:
        logger.info("using the chat template given by --chat-template")
        return read_template_argument(override)
    template = _template_from_config(model_dir) or _template_from_file(model_dir)
    if template is None:
        logger.info("model in %s has no chat template; chat requests will be refused", model_dir)
    return template


def read_template_argument(value: str) -> str:
    """A path to a template file, or the template text itself (text holds braces or newlines; paths do not)."""
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, ValueError):  # a long template is "too long" as a file name, one with NUL is invalid: text
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ConfigError(f"chat template {value[:200]!r} is neither an existing file nor Jinja template text")


def _template_from_config(model_dir: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} of which "default" is used."""
    config = _read_json(model_dir / "tokenizer_config.json") or {}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _template_from_file(model_dir: Path) -> str | None:
    """chat_template.jinja, where transformers 5 saves the template."""
    path = model_dir / CHAT_TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else None
