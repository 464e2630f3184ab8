"""A mapped checkpoint tensor's pages brought into the process before the tensor is sent to a device.

A view of the memory-mapped file maps its pages only when they are touched. Handed to `jax.device_put` as it is, the
transfer's own copy takes those page faults one by one on the transfer's thread; asked for all at once here, on the
loader's thread, they are mapped in one call (Linux's MADV_POPULATE_READ, 5.14 on), or else by touching one byte a
page. On an H100 host, 16 GB from the page cache: 3.5-4.4 s with the pages brought in first against 5.5-6.7 s
without (benchmarks/README.md, "Where a warm start's weight time goes").
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

MADV_POPULATE_READ = 22  # <linux/mman.h>
PAGE = mmap.PAGESIZE


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()  # read-only after import: the C function, or None where there is none


def paged_in(array: np.ndarray) -> np.ndarray:
    """`array` with its pages mapped into the process (a view of the mapped file, or any host array; a
    non-contiguous one is returned untouched). Returns `array` itself."""
    if array.nbytes == 0 or not array.flags.c_contiguous:
        return array
    address = array.ctypes.data
    start = address - address % PAGE
    if _MADVISE is None or _MADVISE(start, address + array.nbytes - start, MADV_POPULATE_READ) != 0:
        np.add.reduce(array.reshape(-1).view(np.uint8)[::PAGE], dtype=np.uint64)  # one byte a page
    return array
