"""The engine core: the step (schedule → run → update), its thread, and its statistics. Token ids only: nothing here
imports the tokenizer, jinja2, HF tokenizers or transformers."""
