"""KV-cache bookkeeping in pure Python, no tensors: the block pool (free list,
reference counts, content hashes for prefix reuse), the block manager (per-sequence block
tables, allocate / append / fork / free, copy-on-write, the swap maps; the only writer of the
tables and of each sequence's KV record, `seq_kv`: tokens computed, block hashes), its prefix
cache (`prefix_cache`), the read-only counters and checks others use (`kv_usage`,
`kv_invariants`) and `kv_view`, the read-only picture of the pool that the dashboard draws.
Imports only `engine.core`.
"""
