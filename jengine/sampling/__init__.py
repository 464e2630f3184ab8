"""Sampling: user-facing parameters (host only), the per-step metadata pytree, and the jitted sampler.

Only `params` is imported here, so `from jengine.sampling import SamplingParams` never imports jax.
"""

from jengine.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
