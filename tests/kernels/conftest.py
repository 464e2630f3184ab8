"""Kernel tests run in Pallas interpret mode on the CPU.

The first interpret-mode lowering imports the Pallas fuser, which adds a config state to every jit cache key and so
re-compiles everything jitted before it (JAX-PALLAS.md §1.4): import it before any test jits anything.
"""

import jax.experimental.pallas.fuser  # noqa: F401
