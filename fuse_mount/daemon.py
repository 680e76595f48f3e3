"""The spoke daemon: connect, load the namespace, open the cache, mount, serve, shut down cleanly.

Order matters for users: nothing is mounted until the hub has answered with its metadata, so a
hub that cannot be reached gives a clear error and no half-made mount; once mounted, the
namespace is complete before any file data has moved.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import pyfuse3
import trio

from fabric.client import HubClient
from fabric.metrics import serve_metrics
from neuralcache.events import LinkEstimate
from neuralcache.trace import TraceWriter

from . import metrics, sd_notify
from .block_cache import BlockCache
from .block_store import DATA_FILE, BlockStore, disk_shortfall
from .control import CONTROL_DIR
from .control_socket import ControlServer
from .fetcher import BlockFetcher
from .filesystem import SpokeFilesystem
from .loop_steps import LongSteps
from .namespace import Namespace
from .prefetch import PrefetchPump, measured_link
from .read_ahead import ReadAhead
from .runtime import MountRecord, cache_lock, remove_record, write_record
from .status import human_bytes

log = logging.getLogger(__name__)

BLOCKS_DIR = "blocks.lmdb"
"""The LMDB environment of the block cache, inside ``--cache-dir``."""
PATH_RECORD = "path.json"
"""The hub client's model of the path to the hub, in the cache directory: a remount over the
same cache starts its transport from it (``fabric.path_memory``)."""

DEFAULT_LINK_BANDWIDTH = 200e6 / 8
"""Bytes/s the prefetch planner assumes until the hub client's congestion control has measured
the path: the 200 Mbit/s WAN this project is measured on. It sizes the prefetch bytes in flight
(bandwidth x (RTT + 0.1 s)) and how far ahead predictions reach."""
DEFAULT_LINK_RTT = 0.060
"""Seconds of round trip the planner assumes until measured (the measured WAN's 60 ms)."""


class MountError(Exception):
    """The mount cannot be made (bad mountpoint, already mounted, ...)."""


@dataclass(frozen=True)
class SpokeConfig:
    hub_host: str
    hub_port: int
    cache_dir: str
    cache_size: int
    mountpoint: str
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    connect_timeout: float = 10.0
    hub_timeout: float = 60.0
    allow_other: bool = True
    prefetch: bool = True
    record_trace: str | None = None  # write a trace of every read and hint to this file
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH  # bytes/s the planner may assume
    link_rtt: float = DEFAULT_LINK_RTT  # seconds
    loop_steps: bool = False  # count the event loop's long steps (loop_steps.py)


def prepare_mountpoint(path: str) -> None:
    """Refuse bad mountpoints; clear a dead daemon's leftover mount."""
    try:
        # statvfs, not stat: the kernel answers stat of a dead FUSE mount's root from its
        # attribute cache, while statvfs always asks the daemon (ENOTCONN once it is gone).
        os.statvfs(path)
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise MountError(f"mountpoint {path}: {exc.strerror}") from None
        log.warning("%s holds the mount of a daemon that died; unmounting it", path)
        subprocess.run(["fusermount3", "-u", "-z", path], check=False)
    if not os.path.isdir(path):
        raise MountError(f"mountpoint {path} is not a directory")
    if os.path.ismount(path):
        raise MountError(f"{path} is already a mount point")


def mount_options(cfg: SpokeConfig) -> set[str]:
    options = set(pyfuse3.default_options)
    # Not "ro": the kernel would refuse writes to the hints control file. The filesystem
    # refuses every other change itself (EROFS).
    options |= {f"fsname=neuralcache@{cfg.hub_host}:{cfg.hub_port}", "subtype=neuralcache"}
    if cfg.allow_other:
        options.add("allow_other")
    return options


def open_cache(cfg: SpokeConfig, namespace: Namespace) -> BlockCache:
    """Open the LMDB cache and drop blocks of file versions the hub no longer has."""
    path = os.path.join(cfg.cache_dir, BLOCKS_DIR)
    cache = BlockCache(BlockStore(path, cfg.cache_size), cfg.cache_size)
    _warn_if_the_disk_is_short(path, cfg.cache_size)
    live = {e.file_id: e.version for e in namespace.files()}
    dropped = cache.purge(lambda key: live.get(key.file_id) == key.version)
    if dropped:
        log.info("dropped %d cached blocks of files that changed or vanished on the hub", dropped)
    return cache


def _warn_if_the_disk_is_short(path: str, capacity: int) -> None:
    """Say at mount, not when the disk fills mid-epoch, that ``--cache-size`` does not fit: past
    that point blocks are read from the hub every time instead of being kept."""
    disk = os.statvfs(path)
    data_file = os.path.join(path, DATA_FILE)
    short = disk_shortfall(capacity, os.path.getsize(data_file) if os.path.exists(data_file)
                           else 0, disk.f_bavail * disk.f_frsize)
    if short:
        log.warning("the cache's filesystem (%s) lacks %s for a full --cache-size of %s; once it "
                    "fills, new blocks are not kept (neuralcache_cache_write_errors_total) and "
                    "their reads go to the hub every time", path, human_bytes(short),
                    human_bytes(capacity))


async def _watch_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s; unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


async def run_spoke(cfg: SpokeConfig, ready: Callable[[str], None]) -> None:
    """Mount and serve until unmounted or signalled. ``ready`` is called once the mount answers."""
    prepare_mountpoint(cfg.mountpoint)
    metrics.LOOP_THREAD.watch()
    if cfg.loop_steps:
        trio.lowlevel.add_instrument(LongSteps())
    with cache_lock(cfg.cache_dir), ExitStack() as files:
        trace_out = None
        if cfg.record_trace:
            trace_out = files.enter_context(_open_trace(cfg.record_trace))
        client = HubClient(cfg.hub_host, cfg.hub_port, name=os.uname().nodename,
                           connect_timeout=cfg.connect_timeout,
                           path_memory=Path(cfg.cache_dir, PATH_RECORD))
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            entries = await client.metadata(timeout=cfg.hub_timeout)
            namespace = Namespace(entries)
            metrics.metadata_loaded(len(namespace))
            if namespace.by_path(CONTROL_DIR) is not None:
                log.warning("the export's %s is hidden by the mount's control directory",
                            CONTROL_DIR)
            cache = open_cache(cfg, namespace)
            metrics.CACHE_BLOCKS.set_function(lambda: len(cache.policy))
            pump = None
            try:
                await nursery.start(cache.run_writer)
                fetcher = BlockFetcher(cache, client, nursery, hub_timeout=cfg.hub_timeout)
                trace = None
                if trace_out is not None:
                    trace = TraceWriter(trace_out, {"hub": f"{cfg.hub_host}:{cfg.hub_port}",
                                                    "mountpoint": cfg.mountpoint,
                                                    "started": time.time()})
                pump = PrefetchPump(namespace, cache, fetcher, prefetch=cfg.prefetch,
                                    link=LinkEstimate(cfg.link_bandwidth, cfg.link_rtt),
                                    measure_link=lambda: measured_link(client.stats()),
                                    trace=trace)
                await nursery.start(pump.run)
                # Before mounting: resolving the mountpoint later would ask this very process.
                await nursery.start(ControlServer(
                    mountpoint=os.path.realpath(cfg.mountpoint),
                    hub=f"{cfg.hub_host}:{cfg.hub_port}", cache_dir=cfg.cache_dir,
                    namespace=namespace, cache=cache, fetcher=fetcher, client=client).serve)
                freeze_long_lived()
                pace_collections()
                fs = SpokeFilesystem(namespace, fetcher, pump, ReadAhead())
                await _serve(cfg, fs, nursery, ready)
                nursery.cancel_scope.cancel()
            finally:
                if pump is not None:
                    pump.close()
                with trio.CancelScope(shield=True):
                    await cache.flush()
                cache.close()


GC_THRESHOLDS = (10_000, 20, 100)
"""The collector's thresholds from mount on; CPython's are (700, 10, 10). A cold read path keeps
objects alive until their block lands (fetch records, views of replies, in-flight keys), so a
young collection every 700 allocations walked thousands of them each time, and full ones came
every few seconds: in a cold hinted ``bench.repro`` run the collector ran 0.68-0.73 s with
CPython's thresholds (0.18 s of it in full collections), 0.19-0.21 s with these, none of it
full (docs/throughput.md, "Garbage collection pauses"). Full collections still come, every 20
million allocations or so, for cycles that live long."""


def pace_collections() -> None:
    """Collect less often (``GC_THRESHOLDS``) and time every collection
    (``neuralcache_gc_seconds_total``); called once the mount's long-lived state is frozen."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.callbacks.append(metrics.CollectionTimer())


def freeze_long_lived() -> None:
    """Leave what the mount has built so far (the namespace, the cache's index, the modules)
    out of every later garbage collection.

    It all lives as long as the mount, and a collection walks every object it tracks, on the
    event loop, which answers nothing meanwhile: a full one took 52-60 ms over the index of a
    4 GiB cache, 0.0 ms once frozen (``python -m bench.gc_pause``). Entries added later to the
    frozen dicts are not walked either. Garbage is collected first, so none of it is kept for
    good.
    """
    gc.collect()
    gc.freeze()


def _open_trace(path: str) -> BinaryIO:
    """The ``--record-trace`` file, opened before anything is mounted so a bad path fails early."""
    try:
        return open(path, "wb")
    except OSError as exc:
        raise MountError(f"cannot record a trace to {path}: {exc.strerror}") from None


async def _announce_when_live(cfg: SpokeConfig, fs: SpokeFilesystem,
                              ready: Callable[[str], None]) -> None:
    """Tell the caller we are ready only once the kernel has a working mount (it answers stat)."""
    await trio.to_thread.run_sync(fs.read_ahead.locate, cfg.mountpoint)
    message = (f"mounted {cfg.mountpoint} ({len(fs.namespace)} entries from "
               f"{cfg.hub_host}:{cfg.hub_port})")
    ready(message)
    sd_notify.notify(READY=1, STATUS=message)


async def _serve(cfg: SpokeConfig, fs: SpokeFilesystem, nursery: trio.Nursery,
                 ready: Callable[[str], None]) -> None:
    server = None
    if cfg.metrics_port is not None:
        server = serve_metrics(cfg.metrics_port, cfg.metrics_addr)
    # Resolve paths before mounting: touching the mountpoint after init, before main() runs,
    # would ask this very process a question it cannot yet answer.
    record = MountRecord(os.getpid(), os.path.realpath(cfg.mountpoint), cfg.cache_dir,
                         f"{cfg.hub_host}:{cfg.hub_port}", cfg.metrics_port)
    try:
        pyfuse3.init(fs, cfg.mountpoint, mount_options(cfg))
    except RuntimeError as exc:
        raise MountError(f"FUSE refused to mount {cfg.mountpoint}: {exc}") from None
    try:
        write_record(record)
        nursery.start_soon(_watch_signals)
        nursery.start_soon(_announce_when_live, cfg, fs, ready)
        await pyfuse3.main()
    finally:
        sd_notify.notify(STOPPING=1, STATUS=f"unmounting {cfg.mountpoint}")
        pyfuse3.close(unmount=True)
        remove_record(record.mountpoint, record.pid)
        if server is not None:
            server.shutdown()
