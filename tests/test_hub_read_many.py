"""A real hub on loopback answering ReadManyRequests (protocol version 4) from raw sockets: each
range's bytes and checksums, each range's own error, refusals that keep the connection, a spoke
too old to ask, and where the ranges are read (on the loop, or in one reader-thread job)."""

from __future__ import annotations

import random
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
import trio

from bench.mount_procs import drop_page_cache
from fabric.checksum import range_checksums
from fabric.export import Confinement, Export
from fabric.hub import INLINE_MAX_BLOCKS, HubServer
from fabric.protocol import (MAX_READ_BLOCKS, PROTOCOL_VERSION, READ_MANY_VERSION, ErrorCode,
                             ErrorReply, FrameDecoder, Hello, Message, MetaEntry, Priority,
                             ReadManyReply, ReadManyRequest, ReadReply, ReadRequest, Welcome,
                             encode)
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import (EVICTED_READ_PAUSE, EVICTED_READ_TRIES, LOCALHOST, metric,
                                  start_hub, trio_test)
from tests.test_export import BOTH_CONFINEMENTS, needs_openat2
from tests.test_hub_client import receive_until_closed

A, B, C = "a.bin", "dir/b.bin", "c.bin"
SIZES = {A: 10 * BLOCK_SIZE, B: 2 * BLOCK_SIZE + 100, C: 2 * INLINE_MAX_BLOCKS * BLOCK_SIZE}
"""B ends in a short block; C is larger than one inline read."""

READS = "neuralcache_hub_reads_total"
ERRORS = "neuralcache_hub_errors_total"
PROTOCOL_ERRORS = ("neuralcache_protocol_errors_total", {"side": "hub"})


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    rng = random.Random(17)
    root = tmp_path / "export"
    (root / "dir").mkdir(parents=True)
    for path, size in SIZES.items():
        (root / path).write_bytes(rng.randbytes(size))
    return root


def entries(root: Path) -> dict[str, MetaEntry]:
    return {e.path: e for e in Export(str(root)).scan() if e.kind == "f"}


def blocks_of(root: Path, path: str, first: int, count: int) -> bytes:
    return (root / path).read_bytes()[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]


def reads() -> tuple[float, float]:
    return metric(READS, {"path": "inline"}), metric(READS, {"path": "thread"})


class RawSpoke:
    """One connection to the hub speaking raw frames."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._decoder = FrameDecoder()
        self._received: list[Message] = []

    async def receive(self) -> Message:
        with trio.fail_after(5):
            while not self._received:
                data = await self.stream.receive_some(1 << 20)
                assert data, "the hub closed the connection"
                self._received += self._decoder.feed(data)
        return self._received.pop(0)

    async def ask(self, msg: Message) -> Message:
        await self.stream.send_all(encode(msg))
        return await self.receive()


@asynccontextmanager
async def raw_spoke(port: int, version: int = PROTOCOL_VERSION) -> AsyncIterator[RawSpoke]:
    """A connection that said hello with ``version`` and got its welcome."""
    async with await trio.open_tcp_stream(LOCALHOST, port) as stream:
        spoke = RawSpoke(stream)
        welcome = await spoke.ask(Hello(version, "raw"))
        assert isinstance(welcome, Welcome) and welcome.version == version
        yield spoke


def count_reader_jobs(server: HubServer) -> list[tuple[Any, ...]]:
    """Every job the hub hands its reader threads from now on, as its arguments."""
    jobs: list[tuple[Any, ...]] = []
    run = server._readers.run

    async def counted(fn: Callable[..., Any], *args: Any) -> Any:
        jobs.append(args)
        return await run(fn, *args)

    server._readers.run = counted  # type: ignore[method-assign]
    return jobs


def assert_served(root: Path, reply: ReadManyReply,
                  expected: list[tuple[str, int, int] | str]) -> None:
    """``reply`` holds, for each range in order, the blocks ``(path, first, count)`` with their
    checksums, or no data and the error code given instead."""
    parts = reply.parts()
    assert len(parts) == len(expected)
    assert {index: code for index, code, _ in reply.errors} == {
        index: want for index, want in enumerate(expected) if isinstance(want, str)}
    for (data, sums), want in zip(parts, expected):
        blocks = b"" if isinstance(want, str) else blocks_of(root, *want)
        assert data == blocks
        assert sums == range_checksums(blocks)


@BOTH_CONFINEMENTS
@trio_test
async def test_every_range_gets_its_own_bytes_or_its_own_error(
        export_dir: Path, confinement: Confinement) -> None:
    files = entries(export_dir)
    a, b, c = files[A], files[B], files[C]
    missing = max(e.file_id for e in files.values()) + 10**9
    ranges = ((a.file_id, a.version, 2, 5),
              (b.file_id, b.version, 1, 8),  # past the end: one block and a short one
              (missing, 1, 0, 1),
              (a.file_id, a.version + 1, 0, 1),  # a version the hub does not have
              (c.file_id, c.version, 7, 3),
              (b.file_id, b.version, 10, 2))  # wholly past the end: nothing, and no error
    expected: list[tuple[str, int, int] | str] = [
        (A, 2, 5), (B, 1, 2), ErrorCode.NOT_FOUND, ErrorCode.STALE, (C, 7, 3), (B, 10, 2)]
    requests = metric("neuralcache_hub_requests_total", {"kind": "read"})
    sent = metric("neuralcache_hub_sent_bytes_total")
    errors = {code: metric(ERRORS, {"code": code})
              for code in (ErrorCode.NOT_FOUND, ErrorCode.STALE)}
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, Export(str(export_dir), confinement=confinement))
        async with raw_spoke(hub.port) as spoke:
            reply = await spoke.ask(ReadManyRequest(41, Priority.PREFETCH, ranges))
        hub.stop()
    assert isinstance(reply, ReadManyReply) and reply.req_id == 41
    assert isinstance(reply.retransmitted, int)
    assert_served(export_dir, reply, expected)
    assert metric("neuralcache_hub_requests_total", {"kind": "read"}) == requests + 1
    assert metric("neuralcache_hub_sent_bytes_total") == sent + len(reply.data)
    for code, before in errors.items():
        assert metric(ERRORS, {"code": code}) == before + 1


@trio_test
async def test_a_refused_request_gets_one_error_and_the_connection_stays_usable(
        export_dir: Path) -> None:
    files = entries(export_dir)
    a, c = files[A], files[C]
    half = MAX_READ_BLOCKS // 2 + 1
    refused = [
        (a.file_id, a.version, 0, half), (c.file_id, c.version, 0, half),  # too many blocks
        (a.file_id, a.version, 0, 1), (a.file_id, a.version, 3, 0),  # an empty range
    ]
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with raw_spoke(hub.port) as spoke:
            for req_id, ranges in ((1, refused[:2]), (2, refused[2:])):
                reply = await spoke.ask(ReadManyRequest(req_id, Priority.DEMAND, tuple(ranges)))
                assert isinstance(reply, ErrorReply)
                assert (reply.req_id, reply.code) == (req_id, ErrorCode.BAD_REQUEST)
            read = await spoke.ask(ReadRequest(3, a.file_id, a.version, 4, 2))
            assert isinstance(read, ReadReply) and read.req_id == 3
            assert read.data == blocks_of(export_dir, A, 4, 2)
            many = await spoke.ask(ReadManyRequest(4, Priority.DEMAND, tuple(refused[2:3])))
            assert isinstance(many, ReadManyReply) and many.req_id == 4
            assert_served(export_dir, many, [(A, 0, 1)])
        hub.stop()


@trio_test
async def test_a_spoke_too_old_to_ask_for_many_ranges_is_disconnected(export_dir: Path) -> None:
    a = entries(export_dir)[A]
    request = ReadManyRequest(2, Priority.DEMAND, ((a.file_id, a.version, 0, 1),))
    errors = metric(*PROTOCOL_ERRORS)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with raw_spoke(hub.port) as bystander:
            async with raw_spoke(hub.port, version=READ_MANY_VERSION - 1) as old:
                read = await old.ask(ReadRequest(1, a.file_id, a.version, 0, 1))
                assert isinstance(read, ReadReply) and read.data == blocks_of(export_dir, A, 0, 1)
                await old.stream.send_all(encode(request))
                assert await receive_until_closed(old.stream) == []
            reply = await bystander.ask(request)
            assert isinstance(reply, ReadManyReply)
            assert_served(export_dir, reply, [(A, 0, 1)])
        async with raw_spoke(hub.port) as newcomer:
            assert isinstance(await newcomer.ask(request), ReadManyReply)
        hub.stop()
    assert metric(*PROTOCOL_ERRORS) == errors + 1


async def read_many_counted(root: Path, ranges: list[tuple[str, int, int]]
                            ) -> tuple[list[tuple[Any, ...]], float, float]:
    """Read ``ranges`` in one ReadManyRequest from a hub serving ``root`` and check the bytes;
    the jobs the hub gave its reader threads, and the inline and thread reads it counted."""
    files = entries(root)
    inline, thread = reads()
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, root)
        jobs = count_reader_jobs(hub.server)
        async with raw_spoke(hub.port) as spoke:
            reply = await spoke.ask(ReadManyRequest(7, Priority.PREFETCH, tuple(
                (files[path].file_id, files[path].version, first, count)
                for path, first, count in ranges)))
        hub.stop()
    assert isinstance(reply, ReadManyReply)
    assert_served(root, reply, list(ranges))
    after = reads()
    return jobs, after[0] - inline, after[1] - thread


@needs_openat2
@trio_test
async def test_small_ranges_of_cached_pages_are_served_inline(export_dir: Path) -> None:
    for path in SIZES:
        (export_dir / path).read_bytes()
    jobs, inline, thread = await read_many_counted(
        export_dir, [(A, 0, 4), (B, 1, 4), (C, 100, 4), (A, 8, 2)])
    assert (jobs, inline, thread) == ([], 1, 0)


@trio_test
async def test_ranges_adding_up_past_the_inline_limit_are_read_in_one_thread_job(
        export_dir: Path) -> None:
    (export_dir / C).read_bytes()
    ranges = [(C, 0, INLINE_MAX_BLOCKS // 2), (A, 0, 10), (C, 70, INLINE_MAX_BLOCKS // 2)]
    jobs, inline, thread = await read_many_counted(export_dir, ranges)
    assert len(jobs) == 1 and len(jobs[0][0]) == len(ranges)
    assert (inline, thread) == (0, 1)


@needs_openat2
@trio_test
async def test_only_the_ranges_of_evicted_pages_go_to_a_thread_all_in_one_job(
        export_dir: Path) -> None:
    (export_dir / A).read_bytes()
    c = entries(export_dir)[C]
    ranges = [(A, 0, 4), (C, 3, 4), (A, 6, 2), (C, 100, 2)]
    evicted = [([(c.file_id, c.version, 3, 4), (c.file_id, c.version, 100, 2)],)]
    for _ in range(EVICTED_READ_TRIES):
        await trio.sleep(EVICTED_READ_PAUSE)
        drop_page_cache(export_dir / C)
        jobs, inline, thread = await read_many_counted(export_dir, ranges)
        if jobs == evicted:
            break
    assert jobs == evicted
    assert (inline, thread) == (0, 1)
