"""Chats → prompt text: the one owner of chat-template rendering and of every check a chat must pass.

A conversation and its template options (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`)
are checked here, whoever receives them (the OpenAI server early, for its 400 before admission; the gRPC client
before sending; the front before rendering), and rendered here, by the model's template in our own Jinja sandbox
rather than by `transformers`: what a template may touch is decided in this file, a template that fails becomes a
clean 400, and a model without a template fails loudly instead of getting an invented format.
`Tokenizer.apply_chat_template` is this module's renderer behind HF's call signature.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from jengine.errors import InvalidRequestError

if TYPE_CHECKING:
    from jengine.tokenizer.tokenizer import Tokenizer

MAX_ERROR_CHARS = 300

Message = Mapping[str, Any]

CHAT_PROMPT_KEYS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                              "tools"})
"""The keys of a chat prompt dict: the messages, the template options, and the tools the template is shown."""


class NoChatTemplateError(InvalidRequestError):
    """A chat request for a model that ships no chat template; the server must be given one, never a guessed format."""

    def __init__(self) -> None:
        super().__init__(
            "this model has no chat template, so chat requests cannot be formatted; start the server with "
            "--chat-template, or pass chat_template= to LLM(...) or LLM.chat (a Jinja file or the template text)",
            param="messages",
            code="no_chat_template",
        )


# --- checks --------------------------------------------------------------------------------------------------------


def check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of messages", param="messages")


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """Continuing the final message excludes opening a new turn after it."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message needs add_generation_prompt set to false (they cannot "
                                  "both be true)", param="continue_final_message")


TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "return_dict", "return_tensors", "chat_template", "raise_exception", "strftime_now",
})
"""Names extra template variables may not take: the renderer's own arguments and the sandbox's helpers."""


def check_template_kwargs(kwargs: Any) -> None:
    """Extra template variables: an object with string keys, none of them the renderer's own (a `tools` there
    would slip past the checks of the request's tools; `add_generation_prompt` would clash with the flag)."""
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    taken = sorted(name for name in kwargs if name in TEMPLATE_ARGUMENTS)
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(taken)}: the renderer sets it",
                                  param="chat_template_kwargs")


def chat_options(options: Mapping[str, Any] | None) -> tuple[dict[str, bool], dict[str, Any]]:
    """(the two flags, the extra template variables) of a chat prompt dict's rendering keys, defaults filled in
    (`add_generation_prompt` true) and every check made."""
    options = options or {}
    flags = {"add_generation_prompt": options.get("add_generation_prompt", True),
             "continue_final_message": options.get("continue_final_message", False)}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be a boolean", param=name)
    check_continuation(**flags)
    kwargs = options.get("chat_template_kwargs") or {}
    check_template_kwargs(kwargs)
    return flags, dict(kwargs)


def join_text_parts(parts: Sequence[Any], where: str) -> str:
    """OpenAI's content parts ([{"type": "text", "text": ...}, ...]) joined by newlines (the models read text only);
    any other part is an InvalidRequestError naming `where` (e.g. "messages[2]")."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            shown = kind if isinstance(kind, str) else type(part).__name__
            raise InvalidRequestError(f"{where}.content part of type {shown[:40]!r} is not supported "
                                      f"(text parts only)", param=f"{where}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def template_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` in OpenAI's shape (`[{"id", "type": "function", "function": {"name",
    "arguments"}}]`), checked, with each arguments JSON text parsed into the object chat templates read (HF's
    convention: templates write `arguments | tojson`). Arguments already an object pass as they are."""
    if not isinstance(tool_calls, Sequence) or isinstance(tool_calls, str):
        raise InvalidRequestError(f"{where}.tool_calls must be an array of tool calls", param=f"{where}.tool_calls")
    return [_template_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]


def _template_tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or (
            call.get("type", "function") != "function"):
        raise InvalidRequestError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                  f"\"arguments\"}}}}", param=where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise InvalidRequestError(f"{where}.function.arguments must be JSON text", param=where) from None
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON object", param=where)
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise InvalidRequestError(f"{where}.id must be a string", param=where)
    return {**call, "type": "function", "function": {**function, "arguments": dict(arguments)}}


def _template_message(message: Any, index: int) -> Any:
    """A message as the template reads it: content parts joined (`join_text_parts`), as the server does, so the
    template sees a string, and tool calls' arguments as objects (`template_tool_calls`). Anything else passes as it
    is (the template decides what it accepts)."""
    if not isinstance(message, Mapping):
        return message
    content, tool_calls = message.get("content"), message.get("tool_calls")
    if isinstance(content, list):
        message = {**message, "content": join_text_parts(content, f"messages[{index}]")}
    if tool_calls:
        message = {**message, "tool_calls": template_tool_calls(tool_calls, f"messages[{index}]")}
    return message


# --- chats → prompts -----------------------------------------------------------------------------------------------


def chat_text(tokenizer: Tokenizer, messages: Any, options: Mapping[str, Any] | None = None) -> str:
    """The chat rendered by the tokenizer's template. `options`: a chat prompt dict's rendering keys
    (`chat_options`) and its `tools` (OpenAI tool objects, which the template lists for the model). Raises
    NoChatTemplateError for a model without a template."""
    check_messages(messages)
    flags, kwargs = chat_options(options)
    tools = (options or {}).get("tools") or None
    if tools is not None and (not isinstance(tools, Sequence) or isinstance(tools, str)):
        raise InvalidRequestError("tools must be a list of tools", param="tools")
    return tokenizer.apply_chat_template([_template_message(m, i) for i, m in enumerate(messages)], **flags,
                                         **kwargs, tools=tools)


def render_chat(tokenizer: Tokenizer, messages: Any, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`{"prompt": text, "prompt_token_ids": ids}` of a chat (`chat_text`), encoded without added special tokens
    (the template already holds BOS)."""
    text = chat_text(tokenizer, messages, options)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


class ChatTemplate:
    """One chat template (its source, or None for a model without one), compiled on first use, rendered in the
    sandbox."""

    def __init__(self, source: str | None) -> None:
        self.source = source

    def compile_errors(self) -> jinja2.TemplateSyntaxError | None:
        """The syntax error of the source, if any (checked at load: whose fault it is, the caller decides)."""
        if self.source is None:
            return None
        try:
            _compile(self.source)
        except jinja2.TemplateSyntaxError as exc:
            return exc
        return None

    def render(self, messages: Sequence[Message], variables: Mapping[str, Any], *, add_generation_prompt: bool,
               continue_final_message: bool, tools: Any = None) -> str:
        """The prompt text: `variables` (special tokens, extra template variables) visible to the template;
        `continue_final_message` ends it right after the last message's text, without its end-of-turn, so the
        model continues it (a prefilled assistant reply)."""
        check_continuation(add_generation_prompt, continue_final_message)
        context = {**variables, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        text = _render(self._compiled, context)
        return _cut_after_final_message(text, messages) if continue_final_message else text

    @cached_property
    def _compiled(self) -> jinja2.Template:
        if self.source is None:
            raise NoChatTemplateError()
        try:
            return _compile(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the chat template is not valid Jinja: {short(exc)}", param="messages") from exc


def _cut_after_final_message(text: str, messages: Sequence[Message]) -> str:
    """`text` up to the end of the last message's content (its trailing whitespace kept where the template kept
    it): what follows it is the template's end-of-turn, which would stop the model continuing the message."""
    final = messages[-1].get("content") if messages and isinstance(messages[-1], Mapping) else None
    core = final.strip() if isinstance(final, str) else ""
    if not core:
        raise InvalidRequestError("continue_final_message needs a final message with text to continue",
                                  param="continue_final_message")
    start = text.rfind(core)
    if start < 0:
        raise InvalidRequestError("the chat template does not show the final message's text as it is, so it "
                                  "cannot be continued", param="continue_final_message")
    end = start + len(core)
    trailing = final[len(final.rstrip()):]
    return text[: end + len(trailing)] if text.startswith(trailing, end) else text[:end]


# --- the sandbox ---------------------------------------------------------------------------------------------------


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` (marks assistant tokens for training); render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        """Drop the tag, keep what it encloses."""
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """HF's sandbox, except that touching an unsafe attribute fails at once.

    Jinja's sandbox returns an undefined value that only fails when used, so `{{ f.__globals__ }}` renders as "";
    a template that probes internals is refused instead.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        """Raise the SecurityError the sandbox would raise later."""
        kind = type(obj).__name__
        raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} of {kind!r} object is unsafe.")


def _make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The sandbox HF renders templates in (same options, filters and globals), so templates behave the same."""
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTagExtension],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(source: str) -> jinja2.Template:
    """Compile in a fresh sandbox (raises jinja2.TemplateSyntaxError)."""
    return _make_environment().from_string(source)


def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
    """Render; anything the template raises becomes a short InvalidRequestError (no stack, no paths)."""
    try:
        return template.render(**context)
    except InvalidRequestError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise InvalidRequestError(f"the chat template did something unsafe: {short(exc)}", param="messages") from exc
    except Exception as exc:  # a template is a program: it can raise anything Python can
        message = f"the chat template failed to render: {type(exc).__name__}: {short(exc)}"
        raise InvalidRequestError(message, param="messages") from exc


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's `tojson`: plain json.dumps (Jinja's own escapes HTML and ignores indent-style arguments templates pass)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    """Templates call this to refuse a conversation (e.g. roles out of order); the message goes back to the client."""
    raise InvalidRequestError(str(message), param="messages")


def _strftime_now(format: str) -> str:
    """Templates that print today's date (Llama-3.1) call this."""
    return datetime.now().strftime(format)


def short(exc: BaseException) -> str:
    """One line of an exception for a client or a log: type name for bare errors, clipped to a few hundred chars."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
