"""KV-cache memory: the block pool, block tables, prefix cache, and the physical K/V tensors."""
