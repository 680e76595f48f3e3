"""Prometheus metrics of the spoke daemon, each defined once here (names follow Prometheus
conventions: ``neuralcache_`` prefix, base units, ``_total`` counters)."""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

from .loop_load import ThreadTimes, WatchedThread
from .loop_metrics import LoopCounterFamily, LoopHistogramFamily, LoopMetrics

SOURCE_CACHE = "cache"
SOURCE_HUB = "hub"
PATH_INLINE = "inline"
PATH_THREAD = "reader_thread"
READ_AHEAD_WARM = "warm"
READ_AHEAD_COLD = "cold"

# Bumped by every FUSE read, on the event loop: without a lock (``loop_metrics``).
READS = LoopCounterFamily("neuralcache_reads_total", "FUSE read requests served, by outcome.",
                          ["outcome"])
OPENS = Counter(
    "neuralcache_opens_total",
    "Data files opened, by the kernel readahead they were given: warm if every block of the "
    "file was cached, else cold.", ["read_ahead"])
EXACT_OPENS = Counter(
    "neuralcache_exact_opens_total",
    "Files opened with direct I/O (no kernel readahead): a job's exact hints named them.")
READ_BYTES = LoopCounterFamily(
    "neuralcache_read_bytes_total",
    "Bytes returned to readers, by where the blocks came from (cache, hub).", ["source"])
CACHE_MISSES = LoopCounterFamily(
    "neuralcache_cache_miss_blocks_total", "Blocks a read needed that were not in the cache.")
CACHE_HITS = LoopCounterFamily(
    "neuralcache_cache_hit_blocks_total", "Blocks a read found in the cache.")
READ_LATENCY = LoopHistogramFamily(
    "neuralcache_read_latency_seconds", "Time to serve one FUSE read, by source.", ["source"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
             1.0, 2.5, 5.0, 10.0))
CACHE_RUN_READS = LoopCounterFamily(
    "neuralcache_cache_run_reads_total",
    "Warm reads of a run of cached blocks from LMDB, by where they ran: 'inline' on the event "
    "loop (short, every page in RAM) or handed to the 'reader_thread'.", ["path"])
REGISTRY.register(LoopMetrics([READS, READ_BYTES, CACHE_MISSES, CACHE_HITS, READ_LATENCY,
                               CACHE_RUN_READS]))
CACHE_READER_WAIT = Histogram(
    "neuralcache_cache_reader_wait_seconds",
    "Time a read handed to the cache's reader thread spent not being read: queued behind "
    "other reads, waiting for the thread to get a CPU, and for the event loop to take the "
    "result back.",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))
CACHE_USED_BYTES = Gauge("neuralcache_cache_used_bytes", "Block bytes held in the cache.")
CACHE_CAPACITY_BYTES = Gauge("neuralcache_cache_capacity_bytes", "The cache's size limit.")
CACHE_BLOCKS = Gauge("neuralcache_cache_blocks", "Blocks held in the cache.")
CACHE_PAGE_IN_BLOCKS = Counter(
    "neuralcache_cache_page_in_blocks_total",
    "Cached blocks whose pages were asked from the disk ahead of their reads, because a "
    "prefetch window reached them, or a read going forward came just before them, while not "
    "all were in RAM.")
CACHE_EVICTIONS = Counter("neuralcache_cache_evictions_total", "Blocks evicted from the cache.")
CACHE_CORRUPT_BLOCKS = Counter(
    "neuralcache_cache_corrupt_blocks_total",
    "Cached blocks that failed their checksum on read; dropped and re-fetched.")
CACHE_WRITE_ERRORS = Counter(
    "neuralcache_cache_write_errors_total",
    "Batches of blocks that could not be written to the cache (disk or map full, or the "
    "writer process gone).")
CACHE_EXTENTS_REFUSED = Counter(
    "neuralcache_cache_extents_refused_total",
    "Extents (16 blocks put together) a write batch stored block by block instead: the cache "
    "file had no 16 free pages side by side.")
CACHE_WRITE_SECONDS = Histogram(
    "neuralcache_cache_write_batch_seconds",
    "Wall time of one batch of cache writes (one LMDB transaction in the writer process), "
    "from hand-off to return: a batch that takes long keeps its blocks in memory meanwhile.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
CACHE_WRITE_OPS = Histogram(
    "neuralcache_cache_write_batch_ops",
    "Puts and evictions in one batch of cache writes (stamps not counted).",
    buckets=(16, 64, 256, 1024, 4096))
METADATA_ENTRIES = Gauge(
    "neuralcache_metadata_entries", "Files, directories and symlinks in the namespace snapshot.")
METADATA_SYNC_AGE = Gauge(
    "neuralcache_metadata_sync_age_seconds",
    "Seconds since the namespace snapshot was loaded from the hub (a mount serves one "
    "snapshot: files added on the hub later appear after a remount).")
FS_ERRORS = Counter(
    "neuralcache_fs_errors_total", "Filesystem requests answered with an error, by errno name.",
    ["errno"])

# Prefetching. The counters mirror the prefetcher's own accounting (PrefetchStats), published
# on its planning tick; a block counts as useful if read after it arrived, late if read while
# its prefetch was still in flight, wasted if evicted or left unread for 300 s. The cache hit
# ratio is cache_hit_blocks / (cache_hit_blocks + cache_miss_blocks) above.
PREFETCH_ISSUED_BYTES = Counter(
    "neuralcache_prefetch_issued_bytes_total", "Bytes the prefetcher asked the hub for.")
PREFETCH_USEFUL_BYTES = Counter(
    "neuralcache_prefetch_useful_bytes_total", "Prefetched bytes read after they arrived.")
PREFETCH_LATE_BYTES = Counter(
    "neuralcache_prefetch_late_bytes_total", "Prefetched bytes read while still in flight.")
PREFETCH_WASTED_BYTES = Counter(
    "neuralcache_prefetch_wasted_bytes_total",
    "Prefetched bytes evicted or left unread for 300 s.")
PREFETCH_FAILED_BYTES = Counter(
    "neuralcache_prefetch_failed_bytes_total", "Prefetched bytes whose fetch failed.")
PREFETCH_PREDICTOR_ISSUED_BYTES = Counter(
    "neuralcache_prefetch_predictor_issued_bytes_total",
    "Bytes the prefetcher asked the hub for, by the predictor whose guess they were.",
    ["predictor"])
PREFETCH_PREDICTOR_USEFUL_BYTES = Counter(
    "neuralcache_prefetch_predictor_useful_bytes_total",
    "Prefetched bytes read after they arrived, by the predictor whose guess they were.",
    ["predictor"])
PREFETCH_INFLIGHT_BYTES = Gauge(
    "neuralcache_prefetch_inflight_bytes", "Prefetch bytes requested and not yet arrived.")
PREFETCH_EVENTS_DROPPED = Counter(
    "neuralcache_prefetch_events_dropped_total",
    "Reads not shown to the prefetcher because its queue was full (it fell behind).")
PREFETCH_READS_UNWATCHED = Counter(
    "neuralcache_prefetch_reads_unwatched_total",
    "Reads not shown to the prefetcher because there was nothing to fetch: every block of the "
    "snapshot cached, every prefetch accounted for, no hints.")
PREFETCH_CPU_SECONDS = Counter(
    "neuralcache_prefetch_cpu_seconds_total",
    "Time spent on prefetching by stage: 'queue' on the read path (handing the read over), "
    "'predict' off it (the prefetcher's work on reads, hints and completions, and its plans; "
    "with --record-trace the trace's too), 'issue' starting what a plan asks for (fetches, and "
    "the page-in of its windows' cached blocks).", ["stage"])
HINT_RECORDS = Counter(
    "neuralcache_prefetch_hints_records_total", "Hint records accepted from the control file.")
HINT_ERRORS = Counter(
    "neuralcache_prefetch_hint_errors_total",
    "Writes to the control file rejected as malformed hint data (EINVAL).")


GC_SECONDS = Counter(
    "neuralcache_gc_seconds_total",
    "Time the garbage collector ran, by generation; it holds the GIL throughout, so on the "
    "event loop every FUSE request waits (fuse_mount.daemon.GC_THRESHOLDS).", ["generation"])


class CollectionTimer:
    """A ``gc.callbacks`` entry that adds each collection's duration to ``GC_SECONDS``."""

    def __init__(self) -> None:
        self._started = 0.0
        self._counters = [GC_SECONDS.labels(str(generation)) for generation in range(3)]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._counters[info["generation"]].inc(time.perf_counter() - self._started)


LOOP_LONG_STEPS = Counter(
    "neuralcache_loop_long_steps_total",
    "Steps of the event loop's tasks that lasted 1 ms or more (wall time), by task: each held "
    "up every FUSE request that came meanwhile. Counted only with 'mount --loop-steps'.",
    ["task"])
LOOP_LONG_STEP_SECONDS = Counter(
    "neuralcache_loop_long_step_seconds_total",
    "Wall time of the steps counted by loop_long_steps_total, by task.", ["task"])


class LoopLoadMetrics(Collector):
    """The event loop's load (``loop_load``): its thread's scheduler times, read when scraped.
    No samples before the loop is watched or where the kernel keeps no such times."""

    def __init__(self, loop: WatchedThread) -> None:
        self.loop = loop

    def describe(self) -> list[Metric]:
        return self._families(None)

    def collect(self) -> list[Metric]:
        return self._families(self.loop.times())

    @staticmethod
    def _families(times: ThreadTimes | None) -> list[Metric]:
        cpu = CounterMetricFamily(
            "neuralcache_loop_cpu_seconds",
            "CPU time of the thread that runs the daemon's event loop (every FUSE request, the "
            "prefetcher, the hub client).")
        waiting = CounterMetricFamily(
            "neuralcache_loop_runqueue_seconds",
            "Time the event loop's thread was ready to run but waited for a CPU. The rates of "
            "this and loop_cpu_seconds added up near 1: the loop is saturated.")
        disk = CounterMetricFamily(
            "neuralcache_loop_disk_waits",
            "Page faults of the event loop's thread that read the disk (major faults): each "
            "held up every FUSE request until the disk answered. Near zero once mounted; reads "
            "that need the disk go to the cache's reader thread.")
        if times is not None:
            cpu.add_metric([], times.cpu_seconds)
            waiting.add_metric([], times.runqueue_seconds)
            disk.add_metric([], times.disk_waits)
        return [cpu, waiting, disk]


class ReaderDiskWaits(Collector):
    """The cache's reader thread's waits for the disk (major faults), read when scraped: a
    warm read whose values are not in RAM waits there, and every read queued behind it."""

    def __init__(self, reader: WatchedThread) -> None:
        self.reader = reader

    def describe(self) -> list[Metric]:
        return [self._family(None)]

    def collect(self) -> list[Metric]:
        return [self._family(self.reader.times())]

    @staticmethod
    def _family(times: ThreadTimes | None) -> Metric:
        disk = CounterMetricFamily(
            "neuralcache_cache_reader_disk_waits",
            "Page faults of the cache's reader thread that read the disk (major faults): each "
            "held up the read in the thread and the reads queued behind it. The cache asks the "
            "kernel for a warm run's pages, and for the stretch ahead of a reader going "
            "forward, before the thread touches them; a page counted here was asked for by "
            "neither.")
        if times is not None:
            disk.add_metric([], times.disk_waits)
        return disk


LOOP_THREAD = WatchedThread()
"""The thread of this process's event loop: the daemon watches it when its loop starts."""
LOOP_LOAD_METRICS = LoopLoadMetrics(LOOP_THREAD)
REGISTRY.register(LOOP_LOAD_METRICS)
READER_THREAD = WatchedThread()
"""The reader thread of the cache this process opened last (``BlockCache``: a daemon opens
one): the cache has it watch itself when it starts."""
READER_DISK_WAITS = ReaderDiskWaits(READER_THREAD)
REGISTRY.register(READER_DISK_WAITS)


def metadata_loaded(entries: int, clock: Callable[[], float] = time.monotonic) -> None:
    """Publish a namespace snapshot just loaded: its size, and an age that counts from now.

    The age is computed at scrape time (monotonic, so a wall-clock step cannot make it jump).
    """
    loaded = clock()
    METADATA_ENTRIES.set(entries)
    METADATA_SYNC_AGE.set_function(lambda: clock() - loaded)
