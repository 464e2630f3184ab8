"""Text at the edge of the engine: tokenizer loading, sandboxed chat templates, UTF-8-safe streaming detokenization.

Importing this package imports neither transformers nor jax; `Tokenizer.from_pretrained` imports transformers.
"""

from jengine.tokenizer.detokenizer import IncrementalDetokenizer
from jengine.tokenizer.tiny import CHATML_TEMPLATE, train_tiny_tokenizer
from jengine.tokenizer.tokenizer import NoChatTemplateError, Tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "IncrementalDetokenizer",
    "NoChatTemplateError",
    "Tokenizer",
    "train_tiny_tokenizer",
]
