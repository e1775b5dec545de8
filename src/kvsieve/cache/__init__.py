from .paged import CacheFullError, PagedKVCache

__all__ = ["PagedKVCache", "CacheFullError"]
