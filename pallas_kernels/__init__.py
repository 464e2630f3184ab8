"""Pallas kernels for jengine, one folder per kernel (`kernel.py`: the kernel and one public jitted wrapper;
`reference.py`: the same signature in pure jnp). Nothing here imports jengine, so the kernels can be tested, lowered
and benchmarked on their own."""
