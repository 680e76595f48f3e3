"""The event loop's load: the kernel's scheduler times and disk waits of a thread, read from
/proc, against what the thread did (spun on a CPU; spun on a CPU another process also wants;
touched mapped pages on disk)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.mount_procs import drop_page_cache
from fuse_mount.block_cache import BlockCache
from fuse_mount.block_store import BlockStore
from fuse_mount.loop_load import ThreadTimes, WatchedThread, thread_times
from fuse_mount.metrics import READER_THREAD, LoopLoadMetrics, ReaderDiskWaits
from fuse_mount.residency import file_resident_bytes

SPIN_SECONDS = 0.2
"""Wall time each test thread spins for."""
PAGES = 64
"""Pages of the file the fault test maps; every other one is touched."""
CLOCK_SLACK = 0.02
"""Allowed difference between two readings of one thread's CPU time (schedstat, thread_time):
both come from the scheduler's runtime of the thread, read moments apart."""


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _times() -> ThreadTimes:
    times = thread_times(threading.get_native_id())
    assert times is not None, "this kernel keeps no scheduler times per thread"
    return times


def test_cpu_time_is_the_threads_own() -> None:
    before, cpu_before = _times(), time.thread_time()
    _spin(SPIN_SECONDS)
    after, cpu_after = _times(), time.thread_time()
    spent = after.cpu_seconds - before.cpu_seconds
    assert spent > 0
    assert abs(spent - (cpu_after - cpu_before)) < CLOCK_SLACK


def test_waiting_for_a_cpu_another_process_holds_counts_as_runqueue_time() -> None:
    cpu = min(os.sched_getaffinity(0))
    allowed = os.sched_getaffinity(0)
    rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(rival.pid, {cpu})
        os.sched_setaffinity(0, {cpu})  # this thread only
        before = _times()
        _spin(SPIN_SECONDS)
        after = _times()
    finally:
        os.sched_setaffinity(0, allowed)
        rival.kill()
        rival.wait()
    assert after.runqueue_seconds > before.runqueue_seconds


def test_no_times_for_a_thread_not_watched_or_gone() -> None:
    assert WatchedThread().times() is None
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    assert done.native_id is not None
    # join returns once the thread's Python work is over, a moment before the kernel ends it.
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/self/task/{done.native_id}") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert thread_times(done.native_id) is None


def test_the_collector_serves_the_watched_threads_times() -> None:
    loop = WatchedThread()
    metrics = LoopLoadMetrics(loop)
    assert [f.samples for f in metrics.collect()] == [[], [], []]  # nothing before the watch
    loop.watch()
    samples = {f.name: f.samples[0].value for f in metrics.collect()}
    assert set(samples) == {"neuralcache_loop_cpu_seconds", "neuralcache_loop_runqueue_seconds",
                            "neuralcache_loop_disk_waits"}
    assert samples["neuralcache_loop_cpu_seconds"] > 0


def test_touching_a_mapped_page_on_disk_counts_as_a_wait_for_the_disk(tmp_path: Path) -> None:
    path = tmp_path / "on-disk"
    path.write_bytes(os.urandom(PAGES * mmap.PAGESIZE))
    drop_page_cache(path)
    if file_resident_bytes(path) > 0:
        pytest.skip("this filesystem keeps the file in the page cache")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        mm.madvise(mmap.MADV_RANDOM)  # one page per fault, no readahead around it
        before = _times()
        touched = [mm[i * mmap.PAGESIZE] for i in range(0, PAGES, 2)]
        after = _times()
    assert len(touched) == PAGES // 2
    assert after.disk_waits - before.disk_waits >= PAGES // 2 * 0.9


def test_a_cache_has_its_reader_thread_watched_for_its_disk_waits(tmp_path: Path) -> None:
    READER_THREAD.tid = None  # an earlier test's cache's, maybe
    cache = BlockCache(BlockStore(str(tmp_path), 1 << 20), 1 << 20)
    try:
        deadline = time.monotonic() + 5
        while READER_THREAD.tid is None:
            assert time.monotonic() < deadline, "the reader thread never watched itself"
            time.sleep(0.001)
        assert READER_THREAD.tid != threading.get_native_id()
        times = thread_times(READER_THREAD.tid)
        assert times is not None  # a live thread of this process
        [family] = ReaderDiskWaits(READER_THREAD).collect()
        assert family.name == "neuralcache_cache_reader_disk_waits"
        assert [s.value for s in family.samples] == [times.disk_waits]
    finally:
        cache.close()
