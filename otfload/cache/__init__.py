"""The distributed shard cache: each checkpoint file fetched once cluster-wide, then read locally.

``wrap_with_cache(source, cache_dir)`` is what a load calls; :class:`ShardCache` does the work.
"""

from otfload.cache.assign import assign_files
from otfload.cache.coordination import Coordinator, JaxCoordinator, LocalCoordinator, current_coordinator
from otfload.cache.integrity import VERIFY_MODES
from otfload.cache.shard_cache import ShardCache, cache_key
from otfload.cache.wrap import default_cache_dir, wrap_with_cache
from otfload.errors import CacheStorageError

__all__ = [
    "VERIFY_MODES",
    "CacheStorageError",
    "Coordinator",
    "JaxCoordinator",
    "LocalCoordinator",
    "ShardCache",
    "assign_files",
    "cache_key",
    "current_coordinator",
    "default_cache_dir",
    "wrap_with_cache",
]
