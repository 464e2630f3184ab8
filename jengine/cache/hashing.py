"""Block hashes for prefix caching: a sha256 chain over full blocks of token ids.

A block's hash commits to its parent's hash, so equal hashes mean equal *prefixes*, not just equal blocks: the K/V
of a block depends on every token before it. sha256 (not Python's `hash`) so that one tenant cannot forge a
collision and read another's cached K/V. Extra keys (the cache salt, later a LoRA name) go into every block, so
requests that must not share never produce the same hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jengine.request import Request

# The parent of a sequence's first block; versioned so a change of encoding can never match old hashes.
ROOT_HASH: bytes = hashlib.sha256(b"jengine/block-hash/v1").digest()


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
    """The hash of one full block given its parent's hash (None for the first block).

    Every variable-length field is length-prefixed, so no two different inputs share an encoding.
    """
    digest = hashlib.sha256(ROOT_HASH if parent is None else parent)
    digest.update(struct.pack(f"<I{len(token_ids)}i", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = key.encode("utf-8")
        digest.update(struct.pack("<I", len(encoded)))
        digest.update(encoded)
    return digest.digest()


def request_extra_keys(request: Request) -> tuple[str, ...]:
    """What besides the tokens decides whether two requests may share K/V (tagged, so keys never collide)."""
    if request.cache_salt is None:
        return ()
    return (f"salt={request.cache_salt}",)


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append to `request.block_hashes` the hash of every full block of `all_token_ids` not hashed yet.

    Idempotent and incremental: the work is O(new full blocks), so it can be called every step. A partial last
    block is never hashed: its content will still change.
    """
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    if len(hashes) >= num_full_blocks:
        return
    extra_keys = request_extra_keys(request)
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else None
    for index in range(len(hashes), num_full_blocks):
        parent = hash_block(parent, tokens[index * block_size:(index + 1) * block_size], extra_keys)
        hashes.append(parent)
