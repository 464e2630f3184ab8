"""The in-place K/V write kernel (interpret mode) against the XLA scatter reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_write import kernel, reference


@pytest.mark.parametrize("tokens_per_program", [1, 8])
@pytest.mark.parametrize("dtype,kv_heads,head_dim", [(jnp.float32, 2, 64), (jnp.bfloat16, 3, 64)])
def test_write_matches_scatter_and_drops_padding(dtype, kv_heads, head_dim, tokens_per_program):
    rng = np.random.default_rng(0)
    layers, blocks, block_size, tokens = 2, 6, 16, 21
    num_slots = blocks * block_size
    cache = jnp.asarray(rng.standard_normal((layers, blocks, block_size, 2, kv_heads, head_dim)), dtype)
    slots = rng.choice(num_slots, tokens, replace=False).astype(np.int32)
    slots[-4:] = num_slots  # padding tokens
    k = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), dtype)

    ours = np.asarray(kernel.write_kv(jnp.array(cache), 1, slots, k, v, interpret=True,
                                      tokens_per_program=tokens_per_program), np.float32)
    ref = np.asarray(reference.write_kv(jnp.array(cache), 1, slots, k, v), np.float32)
    np.testing.assert_array_equal(ours, ref)

    before = np.asarray(cache, np.float32)
    changed = np.argwhere((ours != before).any(axis=(3, 4, 5)))
    written = {(1, s // block_size, s % block_size) for s in slots[:-4]}
    assert {tuple(c) for c in changed} <= written  # nothing else moved: padding dropped, layer 0 untouched
    assert len(changed) >= len(written) - 1  # (a random value could repeat; practically all rows change)
