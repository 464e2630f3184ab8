"""Grammar-constrained decoding: requests whose output must match a JSON schema, a regex, a choice or a grammar.

`params` (host only, no dependency) is what users send; `grammar` turns it into an llguidance grammar and compiles
matchers in the front, which has the tokenizer (llguidance is imported there, lazily); `masks` advances each
request's matcher with its accepted tokens and packs the rows' allowed tokens into an int32 bitmask on the host;
`device` applies that bitmask to the logits inside the jitted sampler.
"""
