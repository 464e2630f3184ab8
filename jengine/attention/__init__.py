"""Attention over the paged KV cache: per-step metadata, backends, and the pure-jnp reference."""
