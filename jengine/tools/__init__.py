"""Tool calling and reasoning on the chat path: the request's tools checked (`request`), the model's text read by
one parser per model family (`parsers`, `reasoning`), streamed as OpenAI deltas (`stream`). Host-only text work: no
jax, nothing of the engine core."""
