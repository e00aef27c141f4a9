"""The lowest layer: mesh and sharding rules, shape buckets, checkpoints, the metrics writer, storage (local
or a bucket), the compile cache, host memory, peers' liveness and launch specs. Imports nothing of marljax
above it (tests/test_imports.py)."""
