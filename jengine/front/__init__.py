"""The front of the engine: `EngineFront` (front.py), the one object `LLM` and `AsyncEngine` submit requests and
collect outputs through, over the input processor (SamplingParams validated once, tokenization with chats rendered by
`jengine.tokenizer.chat`, max_tokens resolved) and the output processor (incremental detokenization, stop strings,
deltas)."""
