"""Tool calling and reasoning on the chat path: the request's tools checked (`request`), forced tool choices turned
into a grammar's schema (`required`), the model's text read by one parser per model family (`parsers`, `reasoning`),
streamed as OpenAI deltas (`stream`). Host-only text work: no jax, nothing of the engine core."""
