"""Tool calling: OpenAI `tools` and `tool_choice` turned into constraints and parsed back into `tool_calls`."""
