"""The distributed shard cache: each checkpoint file fetched once cluster-wide, then read locally.

``wrap_with_cache(source, cache_dir)`` is what a load calls; :class:`ShardCache` does the work.
"""

from otfload.cache.integrity import VERIFY_MODES
from otfload.cache.shard_cache import ShardCache, cache_key
from otfload.cache.wrap import default_cache_dir, wrap_with_cache
from otfload.errors import CacheStorageError

__all__ = [
    "VERIFY_MODES",
    "CacheStorageError",
    "ShardCache",
    "cache_key",
    "default_cache_dir",
    "wrap_with_cache",
]
