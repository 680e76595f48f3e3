"""The prefetcher inside a real mount: sequential prefetching, hints through the control file,
malformed hints, trace recording, --no-prefetch, and the read-only rules the control file made
the filesystem (not the kernel) responsible for."""

from __future__ import annotations

import errno
import mmap
import os
import random
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from fuse_mount.launch import Hub, Spoke
from neuralcache.hints import CONTROL_FILE, announce, encode_hints
from neuralcache.trace import read_trace
from tests.conftest import needs_fuse

pytestmark = [pytest.mark.mount, needs_fuse]

SHARD_BYTES = 4 << 20
SHARDS = 3
CHUNK = 64 * 1024
PAUSE = 0.004
"""Think time between reads: the stand-in for a training step, so prefetches can get ahead."""
METRICS_WAIT = 10.0
"""Seconds to wait for a metric to reach a value (published on the prefetch tick, every 50 ms)."""


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "export"
    rng = random.Random(3)
    files = {f"shards/shard{i}.bin": rng.randbytes(SHARD_BYTES) for i in range(SHARDS)}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root, files


@pytest.fixture
def shard_hub(dataset: tuple[Path, dict[str, bytes]]) -> Iterator[Hub]:
    h = Hub(dataset[0]).start()
    try:
        yield h
    finally:
        h.stop()


def read_slowly(path: Path, ranges: list[tuple[int, int]] | None = None) -> bytes:
    """Read ``ranges`` (default: the whole file in CHUNK steps) one at a time with a pause,
    with kernel readahead off, so every byte the prefetcher did not bring is a miss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        if ranges is None:
            ranges = [(off, CHUNK) for off in range(0, os.fstat(fd).st_size, CHUNK)]
        out = []
        for offset, length in ranges:
            out.append(os.pread(fd, length, offset))
            time.sleep(PAUSE)
        return b"".join(out)
    finally:
        os.close(fd)


def wait_until(condition: Callable[[], bool], timeout: float = METRICS_WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_sequential_read_is_prefetched_and_hits(dataset, shard_hub: Hub, spoke: Spoke) -> None:
    _, files = dataset
    rel = "shards/shard0.bin"
    spoke.mount(shard_hub.address)
    assert read_slowly(spoke.mountpoint / rel) == files[rel]
    wait_until(lambda: spoke.metric("neuralcache_prefetch_useful_bytes_total") > 0)
    assert spoke.metric("neuralcache_prefetch_issued_bytes_total") > 0
    # The loop's time on prefetching is counted by stage: handing reads over, the prefetcher's
    # own work, and starting the fetches it planned.
    for stage in ("queue", "predict", "issue"):
        assert spoke.metric("neuralcache_prefetch_cpu_seconds_total", stage=stage) > 0, stage
    hits = spoke.metric("neuralcache_cache_hit_blocks_total")
    misses = spoke.metric("neuralcache_cache_miss_blocks_total")
    # Only the first reads, before the stride is recognised, should miss (generous margin).
    assert hits > 3 * misses, (hits, misses)


def test_hinted_ranges_are_cached_before_they_are_read(dataset, shard_hub: Hub,
                                                       spoke: Spoke) -> None:
    _, files = dataset
    rel = "shards/shard2.bin"
    rng = random.Random(5)
    sample = 16 * 1024
    # Distinct samples: a page read twice would come from the kernel's page cache the second time.
    ranges = [(i * sample, sample) for i in rng.sample(range(SHARD_BYTES // sample), 40)]
    spoke.mount(shard_hub.address)
    announce(str(spoke.mountpoint), [(rel, off, n) for off, n in ranges], epoch=0, source="r0")
    assert spoke.metric("neuralcache_prefetch_hints_records_total") == 1
    wait_until(lambda: spoke.metric("neuralcache_cache_used_bytes") >= len(ranges) * sample)
    assert spoke.metric("neuralcache_cache_miss_blocks_total") == 0
    got = read_slowly(spoke.mountpoint / rel, ranges)
    assert got == b"".join(files[rel][off:off + n] for off, n in ranges)
    assert spoke.metric("neuralcache_cache_miss_blocks_total") == 0
    assert spoke.metric("neuralcache_cache_hit_blocks_total") == len(ranges) * sample // 4096
    # Every block read was fetched on the hints' word, so the per-predictor counters say so.
    wait_until(lambda: spoke.metric("neuralcache_prefetch_predictor_useful_bytes_total",
                                    predictor="hinted") == len(ranges) * sample)
    assert spoke.metric("neuralcache_prefetch_predictor_issued_bytes_total",
                        predictor="hinted") >= len(ranges) * sample


def test_malformed_hints_fail_with_einval_and_the_mount_keeps_working(
        dataset, shard_hub: Hub, spoke: Spoke) -> None:
    _, files = dataset
    spoke.mount(shard_hub.address)
    control = spoke.mountpoint / CONTROL_FILE
    fd = os.open(control, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as exc:
            os.write(fd, b"\x00\x00\x00\x05hello")  # framed, but not a msgpack map
        assert exc.value.errno == errno.EINVAL
        with pytest.raises(OSError) as exc:  # the handle lost its framing: refused from now on
            os.write(fd, encode_hints([("shards/shard1.bin", 0, 4096)], epoch=0))
        assert exc.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    fd = os.open(control, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as exc:
            os.write(fd, b"\xff\xff\xff\xff")  # a length beyond any record's limit
        assert exc.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    assert spoke.metric("neuralcache_prefetch_hint_errors_total") == 3
    with pytest.raises(OSError) as exc:
        open(control, "rb")
    assert exc.value.errno == errno.EACCES
    announce(str(spoke.mountpoint), [("shards/shard1.bin", 0, 4096)], epoch=0)
    assert spoke.metric("neuralcache_prefetch_hints_records_total") == 1
    assert (spoke.mountpoint / "shards/shard1.bin").read_bytes() == files["shards/shard1.bin"]


def test_record_trace_holds_the_reads_that_happened(dataset, shard_hub: Hub, spoke: Spoke,
                                                    tmp_path: Path) -> None:
    _, files = dataset
    trace_path = tmp_path / "run.trace"
    rel = "shards/shard1.bin"
    ranges = [(0, 8192), (1 << 20, 4096), (3 << 20, 98_304)]  # whole pages: read as asked
    spoke.mount(shard_hub.address, "--record-trace", str(trace_path))
    read_slowly(spoke.mountpoint / rel, ranges)
    announce(str(spoke.mountpoint), [(rel, 0, 4096)], epoch=2, source="r1")
    spoke.umount()
    trace = read_trace(str(trace_path))
    (file_id, (path, size)), = trace.files.items()
    assert (path, size) == (rel, len(files[rel]))
    assert trace.reads["file_id"].tolist() == [file_id] * len(ranges)
    assert list(zip(trace.reads["offset"].tolist(), trace.reads["length"].tolist())) == ranges
    assert (trace.reads["t"] >= 0).all()
    ((_, hint),) = trace.hints
    assert (hint.epoch, hint.source, hint.items) == (2, "r1", ((rel, 0, 4096),))


def test_exact_hints_open_files_without_readahead(dataset, shard_hub: Hub, spoke: Spoke) -> None:
    """A file an exact record names is read as the job asks: no readahead, no page cache."""
    _, files = dataset
    sample = 16 * 1024
    spoke.mount(shard_hub.address, "--no-prefetch")  # only the job's reads fetch anything

    def read_bytes() -> float:
        return sum(spoke.metric("neuralcache_read_bytes_total", source=source)
                   for source in ("cache", "hub"))

    fd = os.open(spoke.mountpoint / "shards/shard0.bin", os.O_RDONLY)
    try:  # not named: the kernel reads ahead of a read at the start of a file
        assert os.pread(fd, sample, 0) == files["shards/shard0.bin"][:sample]
    finally:
        os.close(fd)
    assert read_bytes() > sample
    before = read_bytes()

    rel = "shards/shard1.bin"
    announce(str(spoke.mountpoint), [(rel, 0, sample)], epoch=0, exact=True)
    fd = os.open(spoke.mountpoint / rel, os.O_RDONLY)
    try:
        for _ in range(2):  # no page cache either: both reads reach the mount
            assert os.pread(fd, sample, 0) == files[rel][:sample]
        assert read_bytes() - before == 2 * sample
        assert spoke.metric("neuralcache_exact_opens_total") == 1
        with pytest.raises(OSError) as refused:  # the documented price: no shared mapping
            mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        assert refused.value.errno == errno.ENODEV
    finally:
        os.close(fd)


def test_no_prefetch_issues_nothing(dataset, shard_hub: Hub, spoke: Spoke) -> None:
    _, files = dataset
    rel = "shards/shard0.bin"
    spoke.mount(shard_hub.address, "--no-prefetch")
    assert read_slowly(spoke.mountpoint / rel) == files[rel]
    announce(str(spoke.mountpoint), [("shards/shard2.bin", 0, 1 << 20)], epoch=0)
    time.sleep(0.3)  # several ticks
    assert spoke.metric("neuralcache_prefetch_hints_records_total") == 1
    assert spoke.metric("neuralcache_prefetch_issued_bytes_total") == 0
    assert spoke.metric("neuralcache_cache_hit_blocks_total") == 0
    assert spoke.metric("neuralcache_cache_used_bytes") == len(files[rel])


def test_the_mount_refuses_every_change_and_hides_its_control_directory(
        dataset, shard_hub: Hub, spoke: Spoke) -> None:
    spoke.mount(shard_hub.address)
    mnt = spoke.mountpoint
    shard = mnt / "shards/shard0.bin"
    refused: list[tuple[Callable[[], object], int]] = [
        (lambda: open(shard, "ab"), errno.EROFS),
        (lambda: open(mnt / "shards/new.bin", "wb"), errno.EROFS),
        (lambda: os.truncate(shard, 0), errno.EROFS),
        (lambda: os.chmod(shard, 0o777), errno.EROFS),
        (lambda: os.unlink(shard), errno.EROFS),
        (lambda: os.rename(shard, mnt / "shards/moved.bin"), errno.EROFS),
        (lambda: os.mkdir(mnt / "newdir"), errno.EROFS),
        (lambda: os.symlink("shards", mnt / "link"), errno.EROFS),
        (lambda: os.unlink(mnt / CONTROL_FILE), errno.EPERM),
        (lambda: open(mnt / ".neuralcache/other", "wb"), errno.EPERM),
    ]
    for action, code in refused:
        with pytest.raises(OSError) as exc:
            action()
        assert exc.value.errno == code, action
    assert os.listdir(mnt) == ["shards"]
    assert os.listdir(mnt / ".neuralcache") == ["hints"]
