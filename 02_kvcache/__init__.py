"""Chapter 2: the KV cache manager (LRU block pool with hash-chain prefix caching)."""
