"""Prometheus metrics of the spoke daemon, each defined once here (names follow Prometheus
conventions: ``neuralcache_`` prefix, base units, ``_total`` counters)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SOURCE_CACHE = "cache"
SOURCE_HUB = "hub"

READS = Counter("neuralcache_reads_total", "FUSE read requests served, by outcome.", ["outcome"])
READ_BYTES = Counter(
    "neuralcache_read_bytes_total",
    "Bytes returned to readers, by where the blocks came from (cache, hub).", ["source"])
CACHE_MISSES = Counter(
    "neuralcache_cache_miss_blocks_total", "Blocks a read needed that were not in the cache.")
CACHE_HITS = Counter(
    "neuralcache_cache_hit_blocks_total", "Blocks a read found in the cache.")
READ_LATENCY = Histogram(
    "neuralcache_read_latency_seconds", "Time to serve one FUSE read, by source.", ["source"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
             1.0, 2.5, 5.0, 10.0))
CACHE_USED_BYTES = Gauge("neuralcache_cache_used_bytes", "Block bytes held in the cache.")
CACHE_CAPACITY_BYTES = Gauge("neuralcache_cache_capacity_bytes", "The cache's size limit.")
CACHE_EVICTIONS = Counter("neuralcache_cache_evictions_total", "Blocks evicted from the cache.")
CACHE_CORRUPT_BLOCKS = Counter(
    "neuralcache_cache_corrupt_blocks_total",
    "Cached blocks that failed their checksum on read; dropped and re-fetched.")
CACHE_WRITE_ERRORS = Counter(
    "neuralcache_cache_write_errors_total",
    "Batches of blocks that could not be written to the cache (disk or map full).")
METADATA_ENTRIES = Gauge(
    "neuralcache_metadata_entries", "Files, directories and symlinks in the namespace snapshot.")
FS_ERRORS = Counter(
    "neuralcache_fs_errors_total", "Filesystem requests answered with an error, by errno name.",
    ["errno"])
