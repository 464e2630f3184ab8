"""Host-side scheduling: pure Python over request records; never imports jax."""
