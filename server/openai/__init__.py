"""The OpenAI-compatible HTTP API: request parsing (protocol), response shaping (translate), handlers (routes)."""
