"""KV-cache bookkeeping in host integers: block hashes, the block pool, the per-request manager.

Never imports jax: the scheduler runs it on the host, and the runner alone owns the device arrays.
"""

from jengine.cache.block_pool import BlockPool
from jengine.cache.hashing import hash_block, hash_blocks
from jengine.cache.kv_cache_manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "PrefixCacheStats",
    "hash_block",
    "hash_blocks",
]
