"""A real hub on loopback answering ``Mirror`` pairs (protocol version 7) from raw sockets: the
first copy of a pair is served once, on the connection it names, whichever connection it came in
on; the second is dropped; a copy for a connection that is gone is dropped; connections are
named per spoke; a copy for a connection with no room is left to that connection's own; a Mirror
not followed by a read closes the connection. And a HubClient on a path that loses segments
sends its bulk requests in such pairs and reads right."""

from __future__ import annotations

import random
import socket
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import pytest
import trio

from fabric.export import Export
from fabric.hub import OUTBOX_FRAMES, HubServer, _Link, _Outbox
from fabric.protocol import (MIRROR_VERSION, PROTOCOL_VERSION, Hello, MetaEntry, MetaRequest,
                             Mirror, ReadReply, ReadRequest, Role, Welcome, encode)
from fabric.transport import tcp
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import LOCALHOST, metric, start_hub, trio_test
from tests.test_hub_client import receive_until_closed
from tests.test_hub_read_many import RawSpoke, blocks_of, entries
from tests.test_transport import started_client

FILE = "data.bin"
MIRRORED = "neuralcache_hub_mirrored_requests_total"
PROTOCOL_ERRORS = ("neuralcache_protocol_errors_total", {"side": "hub"})


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    root = tmp_path / "export"
    root.mkdir()
    (root / FILE).write_bytes(random.Random(7).randbytes(64 * BLOCK_SIZE))
    return root


@asynccontextmanager
async def bulk_connection(port: int, spoke: str, link: int | None,
                          version: int = PROTOCOL_VERSION) -> AsyncIterator[RawSpoke]:
    """A bulk connection of ``spoke`` that said hello with ``link``."""
    async with await trio.open_tcp_stream(LOCALHOST, port) as stream:
        conn = RawSpoke(stream)
        welcome = await conn.ask(Hello(version, spoke, Role.BULK, link))
        assert isinstance(welcome, Welcome)
        yield conn


def outcomes() -> dict[str, float]:
    return {o: metric(MIRRORED, {"outcome": o})
            for o in ("served", "duplicate", "no_link", "full")}


def added(before: dict[str, float]) -> dict[str, float]:
    return {o: n - before[o] for o, n in outcomes().items() if n != before[o]}


def read_frame(f: MetaEntry, req_id: int, block: int, mirror_of: int | None = None) -> bytes:
    """A request for block ``block`` of ``f`` as ``req_id``; with ``mirror_of``, the copy of
    one that belongs on that link (its Mirror first)."""
    frame = encode(ReadRequest(req_id, f.file_id, f.version, block, 1))
    return frame if mirror_of is None else encode(Mirror(mirror_of)) + frame


async def reply_to(conn: RawSpoke, req_id: int, root: Path, first: int) -> None:
    """The next message on ``conn`` is the reply to ``req_id``: block ``first`` of the file."""
    reply = await conn.receive()
    assert isinstance(reply, ReadReply) and reply.req_id == req_id
    assert reply.data == blocks_of(root, FILE, first, 1)


@trio_test
async def test_a_pair_is_served_once_on_the_connection_it_names(export_dir: Path) -> None:
    f = entries(export_dir)[FILE]
    before = outcomes()
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with bulk_connection(hub.port, "s", 1) as one, \
                bulk_connection(hub.port, "s", 2) as two:
            # The copy on the other connection comes first, then the one on its own.
            pair = read_frame(f, 7, 3, mirror_of=1)
            await two.stream.send_all(pair)
            await reply_to(one, 7, export_dir, 3)
            await one.stream.send_all(pair)
            # Its own copy first, then the other. A plain request after each shows that
            # nothing else came on either connection before it.
            pair = read_frame(f, 8, 4, mirror_of=1)
            await one.stream.send_all(pair)
            await reply_to(one, 8, export_dir, 4)
            await two.stream.send_all(pair)
            for conn, req_id in ((one, 9), (two, 10)):
                await conn.stream.send_all(read_frame(f, req_id, req_id))
                await reply_to(conn, req_id, export_dir, req_id)
        hub.stop()
    assert added(before) == {"served": 2, "duplicate": 2}


@trio_test
async def test_links_are_named_per_spoke_and_a_gone_one_gets_nothing(export_dir: Path) -> None:
    f = entries(export_dir)[FILE]
    before = outcomes()
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with bulk_connection(hub.port, "a", 1) as a1, \
                bulk_connection(hub.port, "b", 1) as b1, \
                bulk_connection(hub.port, "b", 2) as b2:
            # b's link 1 is b1, not a's connection of the same number.
            await b2.stream.send_all(read_frame(f, 5, 5, mirror_of=1))
            await reply_to(b1, 5, export_dir, 5)
            # A link nobody said hello with: dropped, and the connection goes on.
            await a1.stream.send_all(read_frame(f, 6, 6, mirror_of=3))
            await a1.stream.send_all(read_frame(f, 11, 11))
            await reply_to(a1, 11, export_dir, 11)
        hub.stop()
    assert added(before) == {"served": 1, "no_link": 1}


@pytest.mark.parametrize("after", ["mirror", "meta", "old-version"])
@trio_test
async def test_a_mirror_not_before_a_read_closes_the_connection(export_dir: Path,
                                                                after: str) -> None:
    errors = metric(*PROTOCOL_ERRORS)
    version = MIRROR_VERSION - 1 if after == "old-version" else PROTOCOL_VERSION
    frames = {"mirror": encode(Mirror(1)) + encode(Mirror(1)),
              "meta": encode(Mirror(1)) + encode(MetaRequest(1)),
              "old-version": encode(Mirror(1))}[after]
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with bulk_connection(hub.port, "s", 1 if after != "old-version" else None,
                                   version) as conn:
            await conn.stream.send_all(frames)
            assert await receive_until_closed(conn.stream) == []
        hub.stop()
    assert metric(*PROTOCOL_ERRORS) == errors + 1


@trio_test
async def test_a_client_on_a_lossy_path_mirrors_its_bulk_requests(export_dir: Path) -> None:
    f = entries(export_dir)[FILE]
    before = outcomes()
    mirrored = metric("neuralcache_fabric_mirrored_requests_total")
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        client = await started_client(nursery, hub.port, connections=3)
        # Loopback loses nothing for the hub to report: the client is told the path is lossy.
        client._resends.lossy = lambda now: True  # type: ignore[method-assign]
        data = await client.read(f.file_id, f.version, 0, 64, priority="prefetch",
                                 deadline=trio.current_time() + 10)
        assert data == blocks_of(export_dir, FILE, 0, 64)
        sent = metric("neuralcache_fabric_mirrored_requests_total") - mirrored
        assert sent >= 1
        with trio.fail_after(5):  # the second copies come in after the replies
            while added(before).get("duplicate", 0) < sent:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert added(before) == {"served": sent, "duplicate": sent}


@trio_test
async def test_a_copy_for_a_full_connection_leaves_the_turn_to_its_own(export_dir: Path) -> None:
    f = entries(export_dir)[FILE]
    before = outcomes()
    export = Export(str(export_dir))
    export.scan()
    server = HubServer(export)
    request = ReadRequest(3, f.file_id, f.version, 2, 1)
    try:
        async with trio.open_nursery() as nursery:
            link = _Link(_Outbox(OUTBOX_FRAMES), trio.Semaphore(1), None, nursery)
            link.in_progress.acquire_nowait()  # the connection's one request in progress
            server._serve_twin(link, request, "s")
            assert added(before) == {"full": 1} and not link.served  # the twin is not marked
            link.in_progress.release()
            server._serve_twin(link, request, "s")
            with trio.fail_after(5):
                frame, _ = await link.outbox.receive.receive()
    finally:
        server._readers.close()
    assert blocks_of(export_dir, FILE, 2, 1) in b"".join(bytes(part) for part in frame)
    assert added(before) == {"full": 1, "served": 1}


def test_a_connection_with_nothing_lost_is_not_held() -> None:
    with socket.create_server((LOCALHOST, 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            client.sendall(b"request")
            assert peer.recv(16) == b"request"
            assert not tcp.sends_held(client)
    assert not tcp.sends_held(object())  # not a TCP socket: nothing to tell
