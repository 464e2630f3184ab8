"""Why a request field this server lacks is refused, in words: the message names the field and the reason, never the
value (a JSON dump cut to length reads as noise)."""

from __future__ import annotations

# A field missing here is a feature this server does not build.
_WHY_REFUSED: dict[str, str] = {
    "functions": "the deprecated function calling is not built; use tools",
    "function_call": "the deprecated function calling is not built; use tool_choice",
    "modalities": "only text is generated", "audio": "audio is not supported", "suffix": "insertion is not built",
    "prediction": "predicted outputs are not built", "reasoning_effort": "reasoning effort cannot be set here",
    "web_search_options": "web search is not built", "verbosity": "verbosity control is not built",
    "logits_processors": "custom logits processors are not run", "best_of": "only best_of=1 (no best-of search)",
    "truncate_prompt_tokens": "prompts are never truncated; a prompt that does not fit is refused",
    "return_tokens_as_token_ids": "tokens are returned as text",
    "add_special_tokens": "this endpoint always uses its own setting",
    "echo": "chat completions do not echo the prompt",
}


def refusal_message(name: str) -> str:
    """`name is not supported by this server: why` — the field named, the reason in words, never the value."""
    why = _WHY_REFUSED.get(name, "it is not built")
    return f"{name} is not supported by this server: {why}"
