"""The benches' hubs, spokes and memfs mounts, as context managers that always clean up.

Hub and spoke come from ``fuse_mount.launch`` (started through the CLI, as a user would); this
module adds the ``with`` blocks, the memfs ceiling, and page-cache eviction. Every process a
bench starts is stopped, and every mount unmounted, when its block ends - normally, on an
exception, or on Ctrl-C/SIGTERM (call ``exit_on_sigterm`` first so SIGTERM unwinds like Ctrl-C).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from bench.memfs import READY_LINE
from bench.repro_procs import stop_process
from fuse_mount.block_store import DATA_FILE
from fuse_mount.daemon import BLOCKS_DIR
from fuse_mount.launch import Hub, Spoke, is_mounted, metric


def exit_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt, so ``finally`` blocks unmount and stop processes."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)


def cache_file(cache_dir: str) -> str:
    """The file of a spoke cache directory that holds its blocks (LMDB's data file)."""
    return os.path.join(cache_dir, BLOCKS_DIR, DATA_FILE)


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    """Evict ``path``'s pages from the kernel page cache (``posix_fadvise(DONTNEED)``), so the
    next read of it comes from disk; it touches no other file, unlike ``drop_caches``. Pages a
    process has mapped stay."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # DONTNEED skips dirty pages: a freshly written file must reach disk first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def hub(export: str) -> Iterator[Hub]:
    """A hub exporting ``export`` on a free loopback port, with a metrics endpoint."""
    running = Hub(Path(export))
    try:
        yield running.start()
    finally:
        running.stop()


def hub_sent_bytes(running: Hub) -> float:
    return metric(running.metrics_port, "neuralcache_hub_sent_bytes_total")


@contextlib.contextmanager
def spoke(hub_address: str, cache_dir: str, mountpoint: str, *options: str,
          tree: str | None = None) -> Iterator[tuple[Spoke, float]]:
    """``neuralcache mount`` with ``options`` (from source ``tree`` if given); yields the spoke
    and the seconds the command took (launch to return). Unmounted, or if that fails killed,
    when the block ends."""
    mounted = Spoke(Path(mountpoint), Path(cache_dir), tree=None if tree is None else Path(tree))
    try:
        started = time.perf_counter()
        mounted.mount(hub_address, *options)
        yield mounted, time.perf_counter() - started
    finally:
        mounted.cleanup()


@contextlib.contextmanager
def memfs(mountpoint: str, *sources: str, mapped: bool = False) -> Iterator[list[str]]:
    """``bench.memfs`` serving ``sources`` from memory (``mapped``: from read-only maps of
    them); yields the served files' paths, in the same order."""
    os.makedirs(mountpoint, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "bench.memfs",
                             *(arg for source in sources for arg in ("--source", source)),
                             *(["--mapped"] if mapped else []), mountpoint],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != READY_LINE:
            raise RuntimeError(f"memfs did not start: {line!r} (exit {proc.poll()})")
        yield [os.path.join(mountpoint, os.path.basename(source)) for source in sources]
    finally:
        stop_process(proc)
        if is_mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False)
