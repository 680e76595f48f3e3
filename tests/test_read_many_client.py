"""Small prefetch reads share requests (protocol version 4's ReadManyRequest), over real
loopback sockets, hub and client in one trio process: the bytes, each range's own error and
a corrupted shared reply."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from fabric.client import HubClient, RemoteError
from fabric.protocol import ErrorCode, MetaEntry, ReadManyReply
from tests.fabric_helpers import (CorruptFirst, Proxy, metric, running_client, start_hub,
                                  trio_test)
from tests.test_hub_client import BIG, SMALL, blocks_of, entry, make_export

SAMPLE_BLOCKS = 4
"""A 16 KiB sample, as a shuffled loader reads them: four to a 64 KiB chunk."""

READS = 40

HUB_READ_REQUESTS = ("neuralcache_hub_requests_total", {"kind": "read"})

Outcome = bytes | RemoteError


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    return make_export(tmp_path)


def _offsets(seed: int) -> list[int]:
    """Distinct sample starts in BIG (256 blocks), in no order."""
    return random.Random(seed).sample(range(0, 256 - SAMPLE_BLOCKS), READS)


async def _prefetch_all(client: HubClient, reads: list[tuple[MetaEntry, int, int, int]]
                        ) -> tuple[list[Outcome], float]:
    """Issue every ``(entry, version, first, count)`` prefetch read at once; their outcomes,
    in order, and the read requests the hub counted meanwhile."""
    requests = metric(*HUB_READ_REQUESTS)
    out: list[Outcome] = [b""] * len(reads)

    async def one(i: int, e: MetaEntry, version: int, first: int, count: int) -> None:
        try:
            out[i] = await client.read(e.file_id, version, first, count,
                                       deadline=trio.current_time() + 5, priority="prefetch")
        except RemoteError as exc:
            out[i] = exc

    async with trio.open_nursery() as readers:
        for i, read in enumerate(reads):
            readers.start_soon(one, i, *read)
    return out, metric(*HUB_READ_REQUESTS) - requests


@trio_test
async def test_small_prefetch_reads_share_requests_and_return_their_bytes(
        export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    reads = [(big, big.version, first, SAMPLE_BLOCKS) for first in _offsets(1)]
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port) as client:
            got, requests = await _prefetch_all(client, reads)
        hub.stop()
    assert got == [blocks_of(export_dir, BIG, first, count) for _, _, first, count in reads]
    assert requests < READS / 2  # several samples to a request (four to a 64 KiB chunk)


@trio_test
async def test_a_range_the_hub_refuses_fails_only_its_own_read(export_dir: Path) -> None:
    big, small = entry(export_dir, BIG), entry(export_dir, SMALL)
    # Every fifth read asks for a version of the file the hub does not have; the last reads
    # past the end of a file whose last block is short.
    reads = [(big, big.version + (i % 5 == 0), first, SAMPLE_BLOCKS)
             for i, first in enumerate(_offsets(2))] + [(small, small.version, 0, 8)]
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port) as client:
            got, requests = await _prefetch_all(client, reads)
        hub.stop()
    assert requests < len(reads) / 2
    for (e, version, first, count), outcome in zip(reads, got):
        if version != e.version:
            assert isinstance(outcome, RemoteError) and outcome.code == ErrorCode.STALE
        else:
            assert outcome == blocks_of(export_dir, e.path, first, count)


@trio_test
async def test_a_corrupted_shared_reply_is_refetched_range_by_range(export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    reads = [(big, big.version, first, SAMPLE_BLOCKS) for first in _offsets(3)]
    failures = metric("neuralcache_checksum_failures_total")
    retries = metric("neuralcache_hub_fetch_retries_total")
    corrupt_first = CorruptFirst(ReadManyReply)

    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, corrupt_first)
        await nursery.start(proxy.serve)
        async with running_client(proxy.port) as client:
            got, _ = await _prefetch_all(client, reads)
        nursery.cancel_scope.cancel()
    assert corrupt_first.corrupted == 1
    assert got == [blocks_of(export_dir, BIG, first, count) for _, _, first, count in reads]
    # The flip hit one block of one range: that range alone was asked for again.
    assert metric("neuralcache_checksum_failures_total") == failures + 1
    assert metric("neuralcache_hub_fetch_retries_total") == retries + 1
