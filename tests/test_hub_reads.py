"""Where a real hub on loopback does its reads: on the event loop when every page is cached and
the read is small, in a worker thread otherwise; the bytes the same either way."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio

from bench.mount_procs import drop_page_cache
from fabric.client import RemoteError
from fabric.export import Confinement, Export
from fabric.hub import INLINE_MAX_BLOCKS
from fabric.protocol import ErrorCode, MetaEntry
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import (EVICTED_READ_PAUSE, EVICTED_READ_TRIES, metric, running_client,
                                  start_hub, trio_test)
from tests.test_export import needs_openat2

READS = "neuralcache_hub_reads_total"
FILE_BLOCKS = 2 * INLINE_MAX_BLOCKS + 8
DATA = random.Random(11).randbytes(FILE_BLOCKS * BLOCK_SIZE)


def reads() -> tuple[float, float]:
    return metric(READS, {"path": "inline"}), metric(READS, {"path": "thread"})


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    root = tmp_path / "export"
    root.mkdir()
    (root / "f.bin").write_bytes(DATA)
    return root


def entry(export: Export) -> MetaEntry:
    return next(e for e in export.scan() if e.path == "f.bin")


async def read_counted(export: Export, first: int, count: int) -> tuple[bytes, float, float]:
    """Blocks read through a hub serving ``export``, and the inline and thread reads it did."""
    e = entry(export)
    inline, thread = reads()
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export)
        async with running_client(hub.port) as client:
            data = await client.read(e.file_id, e.version, first, count,
                                     deadline=trio.current_time() + 10)
        nursery.cancel_scope.cancel()
    after = reads()
    return data, after[0] - inline, after[1] - thread


@needs_openat2
@trio_test
async def test_a_small_read_of_cached_pages_is_served_inline(export_dir: Path) -> None:
    (export_dir / "f.bin").read_bytes()
    data, inline, thread = await read_counted(Export(str(export_dir)), 3, 4)
    assert data == DATA[3 * BLOCK_SIZE:7 * BLOCK_SIZE]
    assert inline >= 1 and thread == 0


@needs_openat2
@trio_test
async def test_a_read_of_evicted_pages_goes_to_a_thread(export_dir: Path) -> None:
    export = Export(str(export_dir))
    for _ in range(EVICTED_READ_TRIES):
        await trio.sleep(EVICTED_READ_PAUSE)
        drop_page_cache(export_dir / "f.bin")
        data, _, thread = await read_counted(export, 3, 4)
        assert data == DATA[3 * BLOCK_SIZE:7 * BLOCK_SIZE]
        if thread:
            break
    assert thread >= 1


@needs_openat2
@trio_test
async def test_a_read_above_the_inline_limit_goes_to_a_thread_though_cached(
        export_dir: Path) -> None:
    (export_dir / "f.bin").read_bytes()
    count = INLINE_MAX_BLOCKS + 1
    data, inline, thread = await read_counted(Export(str(export_dir)), 1, count)
    assert data == DATA[BLOCK_SIZE:(1 + count) * BLOCK_SIZE]
    assert inline == 0 and thread >= 1


@trio_test
async def test_without_openat2_every_read_goes_to_a_thread(export_dir: Path) -> None:
    (export_dir / "f.bin").read_bytes()
    export = Export(str(export_dir), confinement=Confinement.REALPATH)
    data, inline, thread = await read_counted(export, 0, 4)
    assert data == DATA[:4 * BLOCK_SIZE]
    assert inline == 0 and thread >= 1


@needs_openat2
@trio_test
async def test_a_cached_read_of_a_changed_file_is_answered_stale(export_dir: Path) -> None:
    export = Export(str(export_dir))
    e = entry(export)
    os.utime(export_dir / "f.bin", ns=(0, 0))
    errors = metric("neuralcache_hub_errors_total", {"code": ErrorCode.STALE})
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export)
        async with running_client(hub.port) as client:
            with pytest.raises(RemoteError) as info:
                await client.read(e.file_id, e.version, 0, 1, deadline=trio.current_time() + 10)
        nursery.cancel_scope.cancel()
    assert info.value.code == ErrorCode.STALE
    assert metric("neuralcache_hub_errors_total", {"code": ErrorCode.STALE}) > errors
