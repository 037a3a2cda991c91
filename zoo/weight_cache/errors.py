"""The cache's one error kind (``zoo.weight_cache.store`` re-exports it)."""


class CacheError(ValueError):
    """A cache entry that is incomplete, corrupt, or not what the manifest says."""
