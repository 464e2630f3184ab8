"""The bitmask inside the jitted sampler: unpack each row's int32 words to one bit per token and ban the zeros.

Vectorised over the batch and the vocabulary (shifts and a compare, fused by XLA); tokens past the mask's words
(the model's padded vocabulary rows beyond the tokenizer's) are banned. Free rows carry all-ones words.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def apply_token_mask(logits: Float[Array, "n vocab"], mask: Int[Array, "n words"]) -> Float[Array, "n vocab"]:
    """`logits` with -inf wherever a row's bit is 0 (bit t % 32 of word t // 32, little-endian as llguidance)."""
    n, vocab = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [n, words, 32]
    allowed = bits.reshape(n, -1).astype(jnp.bool_)
    width = allowed.shape[1]
    if width < vocab:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - width)))
    return jnp.where(allowed[:, :vocab], logits, -jnp.inf)
