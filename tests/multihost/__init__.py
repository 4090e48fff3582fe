"""Multi-process loading and the distributed shard cache (real JAX processes, real servers)."""
