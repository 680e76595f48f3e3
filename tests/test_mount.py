"""End-to-end: a real hub subprocess, a real spoke daemon, a real FUSE mount."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import needs_fuse
from fuse_mount import read_ahead
from fuse_mount.launch import Hub, Spoke, is_mounted

pytestmark = [pytest.mark.mount, needs_fuse]

HUB_TIMEOUT = "2"  # seconds a miss may wait for a lost hub in these tests


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def read_all(mnt: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (mnt / rel).read_bytes() == data, rel


def test_every_file_reads_back_byte_for_byte(export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address)
    read_all(spoke.mountpoint, files)
    assert spoke.metric("neuralcache_read_bytes_total", source="hub") > 0


def test_namespace_is_browsable_before_any_data_moves(export, hub: Hub, spoke: Spoke) -> None:
    root, files = export
    spoke.mount(hub.address)
    listing = subprocess.run(["ls", "-lR", str(spoke.mountpoint)], capture_output=True,
                             text=True, check=True).stdout
    found = subprocess.run(["find", str(spoke.mountpoint), "-type", "f"], capture_output=True,
                           text=True, check=True).stdout.split()
    assert sorted(os.path.relpath(p, spoke.mountpoint) for p in found) == sorted(files)
    for rel, data in files.items():
        assert os.stat(spoke.mountpoint / rel).st_size == len(data)
    assert "empty_dir" in listing
    assert os.readlink(spoke.mountpoint / "inside_link") == "top0.bin"
    assert not os.path.lexists(spoke.mountpoint / "escape_link"), "symlink leaving the export"
    assert spoke.metric("neuralcache_reads_total", outcome="ok") == 0
    assert spoke.metric("neuralcache_cache_miss_blocks_total") == 0


def test_a_wholly_cached_file_is_opened_with_the_warm_readahead(
        export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address, "--no-prefetch")  # nothing but the reads below fetches
    dev = os.stat(spoke.mountpoint).st_dev
    setting = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    assert int(setting.read_text()) == read_ahead.COLD_KB  # set once the mount is live
    other, big = sorted(files, key=lambda rel: len(files[rel]))[-2:]  # the two largest

    def opened(rel: str) -> int:
        """Open ``rel``; the readahead set for it, which the kernel took into the file."""
        with open(spoke.mountpoint / rel, "rb"):
            return int(setting.read_text())
    assert opened(big) == read_ahead.COLD_KB
    read_all(spoke.mountpoint, {big: files[big]})
    assert opened(big) == read_ahead.WARM_KB
    assert opened(other) == read_ahead.COLD_KB
    assert spoke.metric("neuralcache_opens_total", read_ahead="warm") == 1
    assert spoke.metric("neuralcache_opens_total", read_ahead="cold") == 3  # read_all's own


def test_mount_is_read_only(export, hub: Hub, spoke: Spoke) -> None:
    spoke.mount(hub.address)
    with pytest.raises(OSError) as exc:
        open(spoke.mountpoint / "top0.bin", "r+b")
    assert exc.value.errno in (errno.EROFS, errno.EACCES)


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory):
    """One mount for the property test (hypothesis runs many examples against it)."""
    from tests.conftest import make_tree
    base = tmp_path_factory.mktemp("prop")
    root = base / "export"
    root.mkdir()
    files = make_tree(root, seed=11)
    hub = Hub(root).start()
    spoke = Spoke(base / "mnt", base / "cache")
    try:
        spoke.mount(hub.address)
        yield spoke, root, files
    finally:
        spoke.cleanup()
        hub.stop()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_offsets_and_sizes_match_the_export(shared_mount, data) -> None:
    spoke, root, files = shared_mount
    rel = data.draw(st.sampled_from(sorted(files)))
    size = len(files[rel])
    offset = data.draw(st.integers(0, size + 5000))
    length = data.draw(st.integers(0, 300_000))
    fd = os.open(spoke.mountpoint / rel, os.O_RDONLY)
    try:
        got = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    assert got == files[rel][offset:offset + length]


def test_concurrent_readers_get_the_right_bytes(export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address)
    errors: list[str] = []
    big = [rel for rel, d in files.items() if len(d) > 100_000]

    def reader(i: int) -> None:
        for rel in big[i % len(big):] + big[:i % len(big)]:
            with open(spoke.mountpoint / rel, "rb", buffering=0) as f:
                chunks = []
                while chunk := f.read(16384 + i * 4096):
                    chunks.append(chunk)
            if b"".join(chunks) != files[rel]:
                errors.append(rel)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    # Eight readers of the same blocks share fetches: the hub sent each block about once.
    hub_bytes = spoke.metric("neuralcache_hub_sent_bytes_total")  # not on the spoke
    assert hub_bytes == 0
    total = sum(len(files[r]) for r in big)
    assert spoke.metric("neuralcache_cache_miss_blocks_total") * 4096 < 3 * total


def test_warm_remount_serves_cached_data_without_the_hub(export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address)
    read_all(spoke.mountpoint, files)
    spoke.umount()
    spoke.mount(hub.address, "--hub-timeout", HUB_TIMEOUT)
    hub.stop()
    read_all(spoke.mountpoint, files)
    assert spoke.metric("neuralcache_read_bytes_total", source="hub") == 0
    assert spoke.metric("neuralcache_read_bytes_total", source="cache") == sum(
        len(d) for d in files.values())


def test_file_changed_on_the_hub_between_mounts_is_never_served_stale(
        export, hub: Hub, spoke: Spoke) -> None:
    root, files = export
    rel = "top4.bin"
    spoke.mount(hub.address)
    assert (spoke.mountpoint / rel).read_bytes() == files[rel]
    spoke.umount()
    path = root / rel
    st = path.stat()
    new = bytes(b ^ 0xFF for b in files[rel])  # same size
    path.write_bytes(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same mtime too: only ctime moved
    spoke.mount(hub.address)
    assert (spoke.mountpoint / rel).read_bytes() == new


def test_killed_daemon_is_remounted_and_reads_correctly(export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address)
    stop = threading.Event()

    def heavy_reads() -> None:
        while not stop.is_set():
            for rel in files:
                try:
                    (spoke.mountpoint / rel).read_bytes()
                except OSError:
                    return  # the daemon is gone

    readers = [threading.Thread(target=heavy_reads) for _ in range(4)]
    for t in readers:
        t.start()
    try:
        threading.Event().wait(0.5)
        spoke.kill()
    finally:
        stop.set()
        for t in readers:
            t.join(30)
    assert not is_mounted(str(spoke.mountpoint))
    spoke.mount(hub.address)
    read_all(spoke.mountpoint, files)


def test_hub_unreachable_at_mount_time_fails_cleanly(tmp_path: Path, spoke: Spoke) -> None:
    from fuse_mount.launch import free_port
    result = spoke.mount(f"127.0.0.1:{free_port()}", "--connect-timeout", "1", check=False)
    assert result.returncode != 0
    assert "cannot reach the hub" in result.stderr
    assert not is_mounted(str(spoke.mountpoint))


def test_hub_lost_mid_run_fails_misses_with_eio_then_recovers(export, hub: Hub,
                                                              spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address, "--hub-timeout", HUB_TIMEOUT)
    cached, missing = "top0.bin", "top8.bin"
    assert (spoke.mountpoint / cached).read_bytes() == files[cached]
    hub.stop()
    assert (spoke.mountpoint / cached).read_bytes() == files[cached]
    with pytest.raises(OSError) as exc:
        (spoke.mountpoint / missing).read_bytes()
    assert exc.value.errno == errno.EIO
    hub.start()  # same port
    wait_for(lambda: spoke.metric("neuralcache_hub_link_up") == 1, timeout=15)
    assert (spoke.mountpoint / missing).read_bytes() == files[missing]


def test_cache_stays_within_its_size(export, hub: Hub, spoke: Spoke) -> None:
    _, files = export
    spoke.mount(hub.address, "--cache-size", "1M")
    read_all(spoke.mountpoint, files)
    assert spoke.metric("neuralcache_cache_used_bytes") <= 1 << 20
    assert spoke.metric("neuralcache_cache_evictions_total") > 0


def test_a_background_mount_shows_its_start_up_warnings(export, hub: Hub, spoke: Spoke) -> None:
    """A cache larger than its disk holds is only a warning, but one the terminal shows."""
    _, files = export
    result = spoke.mount(hub.address, "--cache-size", "20T")
    assert "warning: the cache's filesystem" in result.stderr and "lacks" in result.stderr
    assert "warning" not in result.stdout  # the "mounted" line stays the stdout's only one
    read_all(spoke.mountpoint, files)


def test_corrupted_blocks_are_rejected_never_served(export, hub: Hub, spoke: Spoke) -> None:
    from tests.mounts import start_proxy
    _, files = export
    rel = "top8.bin"
    with start_proxy(hub.address, "always") as proxy:
        spoke.mount(proxy, "--hub-timeout", HUB_TIMEOUT)
        with pytest.raises(OSError) as exc:
            (spoke.mountpoint / rel).read_bytes()
        assert exc.value.errno == errno.EIO
        assert spoke.metric("neuralcache_checksum_failures_total") > 0
        assert spoke.metric("neuralcache_cache_used_bytes") == 0


def test_a_corrupted_block_is_fetched_again(export, hub: Hub, spoke: Spoke) -> None:
    from tests.mounts import start_proxy
    _, files = export
    with start_proxy(hub.address, "once") as proxy:
        spoke.mount(proxy)
        read_all(spoke.mountpoint, files)
        assert spoke.metric("neuralcache_checksum_failures_total") >= 1
