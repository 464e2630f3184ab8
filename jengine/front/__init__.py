"""The front of the engine: a request's text and parameters in (validation, tokenization, chat rendering), its
outputs out (incremental detokenization, stop strings, deltas). Shared by `LLM` and `AsyncEngine`."""
