"""A mapped tensor's pages brought in before its transfer: the same array back, its bytes untouched."""

import mmap

import numpy as np
import pytest

from jengine.models import page_in


@pytest.mark.parametrize("with_madvise", [True, False])
def test_paged_in_returns_the_mapped_view_unchanged(tmp_path, monkeypatch, with_madvise):
    if not with_madvise:  # the one-byte-a-page fallback (no Linux madvise, or a kernel before 5.14)
        monkeypatch.setattr(page_in, "_MADVISE", None)
    expected = np.random.default_rng(0).standard_normal((3 * page_in.PAGE + 40,)).astype(np.float32)
    path = tmp_path / "tensor.bin"
    path.write_bytes(b"\0" * 12 + expected.tobytes())  # a tensor that starts inside a page
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, np.float32, offset=12, count=expected.size)
    assert page_in.paged_in(view) is view
    np.testing.assert_array_equal(view, expected)
    strided = view[::2]
    assert page_in.paged_in(strided) is strided  # not contiguous: left to the transfer
    empty = view[:0]
    assert page_in.paged_in(empty) is empty
