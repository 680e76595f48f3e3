"""Hub server and hub client over real loopback sockets, both in one trio process.

Hostile peers are raw sockets or an in-process proxy that rewrites the hub's frames; the
timeouts are small so the whole file runs in a few seconds.
"""

from __future__ import annotations

import math
import os
import random
import re
import socket
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from fabric.client import (CHECKSUM_ATTEMPTS, DEFAULT_CONNECTIONS, LOSSY_PATH_CONNECTIONS,
                           ChecksumError, HubClient, HubUnavailable,
                           ReadData, RemoteError)
from fabric.export import Export
from fabric.protocol import (MAX_FRAME, MAX_READ_BLOCKS, META_CHUNK_ENTRIES, PROTOCOL_VERSION,
                             ErrorCode, ErrorReply, FrameDecoder, Hello, Message, MetaEntry,
                             MetaReply, MetaRequest, ReadReply, ReadRequest, Role,
                             Welcome, encode)
from fabric.transport import kernel_cc, tcp
from fabric.transport.resend_rate import ResendRate, SteadyLoss
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import (LOCALHOST, CorruptFirst, Proxy, ReportLoss, flip_reply,
                                  metric, running_client, start_hub, trio_test)


BIG = "big.bin"
SMALL = "dir/small.bin"


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    return make_export(tmp_path)


def make_export(tmp_path: Path) -> Path:
    """BIG (256 random blocks) and SMALL (two blocks and 100 bytes) under ``tmp_path``."""
    rng = random.Random(3)
    root = tmp_path / "export"
    (root / "dir").mkdir(parents=True)
    (root / BIG).write_bytes(rng.randbytes(256 * BLOCK_SIZE))
    (root / SMALL).write_bytes(rng.randbytes(2 * BLOCK_SIZE + 100))
    return root


def entry(root: Path, path: str) -> MetaEntry:
    return next(e for e in Export(str(root)).scan() if e.path == path)


def blocks_of(root: Path, path: str, first: int, count: int) -> bytes:
    return (root / path).read_bytes()[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]


async def read_and_check(client: Any, root: Path, path: str, first: int, count: int,
                         timeout: float = 2.0) -> None:
    e = entry(root, path)
    got = await client.read(e.file_id, e.version, first, count,
                            deadline=trio.current_time() + timeout)
    assert got == blocks_of(root, path, first, count)


@trio_test
async def test_many_concurrent_reads_on_one_connection(export_dir: Path) -> None:
    big, small = entry(export_dir, BIG), entry(export_dir, SMALL)
    rng = random.Random(5)
    retries = metric("neuralcache_hub_fetch_retries_total")
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        connects = metric("neuralcache_hub_connected_spokes")
        async with running_client(hub.port) as client:
            results: dict[int, tuple[MetaEntry, int, int, bytes]] = {}

            async def one(i: int, e: MetaEntry, first: int, count: int) -> None:
                data = await client.read(e.file_id, e.version, first, count,
                                         deadline=trio.current_time() + 5)
                results[i] = (e, first, count, data)

            async with trio.open_nursery() as readers:
                for i in range(150):
                    e = big if i % 3 else small
                    first = rng.randrange(math.ceil(e.size / BLOCK_SIZE))
                    readers.start_soon(one, i, e, first, rng.randint(1, 48))
            assert metric("neuralcache_hub_connected_spokes") == connects + 1
        hub.stop()
    assert len(results) == 150
    for e, first, count, data in results.values():
        assert data == blocks_of(export_dir, e.path, first, count)
    assert metric("neuralcache_hub_fetch_retries_total") == retries


@trio_test
async def test_metadata_of_a_large_tree_streams_in_several_chunks(tmp_path: Path) -> None:
    root = tmp_path / "export"
    for d in range(10):
        (root / f"d{d}").mkdir(parents=True)
        for f in range(520):
            (root / f"d{d}" / f"f{f}").write_bytes(b"x" * (f % 7))
    frames = 0

    async def count_meta_frames(msg: Message) -> Message:
        nonlocal frames
        frames += isinstance(msg, MetaReply)
        return msg

    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, root)
        proxy = Proxy(hub.port, count_meta_frames)
        await nursery.start(proxy.serve)
        async with running_client(proxy.port) as client:
            entries = await client.metadata(timeout=5)
        nursery.cancel_scope.cancel()
    expected = Export(str(root)).scan()
    assert len(entries) == 1 + 10 + 5200 > META_CHUNK_ENTRIES
    assert entries == expected
    assert frames == math.ceil(len(expected) / META_CHUNK_ENTRIES)


@trio_test
async def test_refused_reads_raise_remote_error_and_the_link_stays_up(export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port) as client:
            deadline = trio.current_time() + 2
            cases = [(big.file_id + 10**9, big.version, 0, 1, ErrorCode.NOT_FOUND),
                     (big.file_id, big.version + 1, 0, 1, ErrorCode.STALE),
                     (big.file_id, big.version, 0, MAX_READ_BLOCKS + 1, ErrorCode.BAD_REQUEST),
                     (big.file_id, big.version, 0, 0, ErrorCode.BAD_REQUEST)]
            for file_id, version, first, count, code in cases:
                with pytest.raises(RemoteError) as info:
                    await client.read(file_id, version, first, count, deadline=deadline)
                assert info.value.code == code
            assert client.connected
            await read_and_check(client, export_dir, BIG, 3, 2)
        hub.stop()


@trio_test
async def test_a_read_far_past_the_end_returns_nothing_and_the_hub_keeps_serving(
        export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port) as client:
            for first in (300, 2**63, 2**64 - 1):
                assert await client.read(big.file_id, big.version, first, MAX_READ_BLOCKS,
                                         deadline=trio.current_time() + 2) == b""
            await read_and_check(client, export_dir, BIG, 0, 4)
        hub.stop()


HELLO = encode(Hello(PROTOCOL_VERSION, "raw"))
BAD_PEERS = {
    # name: (greet first?, bytes sent next, then half-close?, replies expected, protocol errors)
    "garbage-payload": (False, struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", False, [], 1),
    "garbage-after-hello": (True, b"\x00\x00\x00\x03\x93\x01\x02", False, [], 1),
    "oversized-header": (True, struct.pack(">I", MAX_FRAME + 1), False, [], 1),
    "truncated-then-eof": (True, encode(MetaRequest(1))[:5], True, [], 1),
    "no-hello": (False, encode(MetaRequest(1)), False, [], 1),
    "reply-sent-by-a-spoke": (True, encode(Welcome(1, "x")), False, [], 1),
    "second-hello": (True, HELLO, False, [], 1),
    "wrong-version": (False, encode(Hello(PROTOCOL_VERSION + 1, "raw")), False, [ErrorReply], 1),
    "clean-eof": (True, b"", True, [], 0),
}


async def receive_until_closed(stream: trio.SocketStream) -> list[Message]:
    """Everything the hub sends until it closes the connection."""
    decoder = FrameDecoder()
    out: list[Message] = []
    with trio.fail_after(2):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # a reset is a close too
                return out
            if not data:
                return out
            out += decoder.feed(data)


@pytest.mark.parametrize("case", list(BAD_PEERS))
@trio_test
async def test_a_bad_peer_is_disconnected_and_others_keep_working(
        export_dir: Path, case: str) -> None:
    greet, payload, half_close, expected_replies, expected_errors = BAD_PEERS[case]
    errors = metric("neuralcache_protocol_errors_total", {"side": "hub"})
    retries = metric("neuralcache_hub_fetch_retries_total")
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port) as client:
            await read_and_check(client, export_dir, BIG, 0, 8)
            async with await trio.open_tcp_stream(LOCALHOST, hub.port) as raw:
                if greet:
                    await raw.send_all(HELLO)
                    decoder = FrameDecoder()
                    while not (welcome := decoder.feed(await raw.receive_some(65536))):
                        pass
                    assert [type(m) for m in welcome] == [Welcome]
                await raw.send_all(payload)
                if half_close:
                    await raw.send_eof()
                replies = await receive_until_closed(raw)
            assert [type(m) for m in replies] == expected_replies
            await read_and_check(client, export_dir, BIG, 8, 8)
            await read_and_check(client, export_dir, SMALL, 0, 3)
        async with running_client(hub.port) as newcomer:  # still accepting connections
            await read_and_check(newcomer, export_dir, SMALL, 2, 1)
        hub.stop()
    assert metric("neuralcache_protocol_errors_total", {"side": "hub"}) == errors + expected_errors
    assert metric("neuralcache_hub_fetch_retries_total") == retries


@trio_test
async def test_a_client_that_never_reads_does_not_stall_another(export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    flood = 200
    requested = metric("neuralcache_hub_requests_total", {"kind": "read"})
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir, max_outstanding=4)
        async with await trio.open_tcp_stream(LOCALHOST, hub.port) as slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            # Each request asks for the whole 1 MiB file; the replies are never read.
            await slow.send_all(HELLO + b"".join(
                encode(ReadRequest(i, big.file_id, big.version, 0, 256)) for i in range(flood)))
            await trio.sleep(0.2)  # let the hub fill the slow connection's buffers
            async with running_client(hub.port) as client:
                with trio.fail_after(5):
                    for first in range(0, 256, 32):
                        await read_and_check(client, export_dir, BIG, first, 32, timeout=5)
                    assert len(await client.metadata(timeout=5)) == 4
        hub.stop()
    taken_from_slow = metric("neuralcache_hub_requests_total", {"kind": "read"}) - requested - 8
    assert taken_from_slow < flood  # the hub stopped taking requests from the stuck connection


@trio_test
async def test_a_stopped_hub_gives_hub_unavailable_and_a_restarted_one_is_redialled(
        export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port, connect_timeout=1.0) as client:
            await read_and_check(client, export_dir, BIG, 0, 1)
            hub.stop()
            start = trio.current_time()
            with pytest.raises(HubUnavailable):
                await client.read(big.file_id, big.version, 0, 1, deadline=start + 1.0)
            elapsed = trio.current_time() - start
            assert 0.9 <= elapsed < 1.9
            assert metric("neuralcache_hub_link_up") == 0
            hub = await start_hub(nursery, export_dir, port=hub.port)
            await read_and_check(client, export_dir, BIG, 5, 3, timeout=5)
            assert metric("neuralcache_hub_link_up") == 1
        hub.stop()


@trio_test
async def test_start_prefetch_calls_back_with_the_bytes_or_hub_unavailable_past_its_deadline(
        export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    results: list[bytes | BaseException] = []
    landed = trio.Event()

    def on_done(result: list[ReadData] | BaseException) -> None:
        results.append(result if isinstance(result, BaseException) else b"".join(result))
        landed.set()

    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port, connect_timeout=1.0) as client:
            client.start_prefetch(big.file_id, big.version, 3, 40,
                                  deadline=trio.current_time() + 5, on_done=on_done)
            await landed.wait()
            assert results == [blocks_of(export_dir, BIG, 3, 40)]
            hub.stop()
            landed = trio.Event()
            start = trio.current_time()
            client.start_prefetch(big.file_id, big.version, 0, 1, deadline=start + 0.5,
                                  on_done=on_done)
            await landed.wait()
            assert isinstance(results[1], HubUnavailable)
            # Checked once a second (PREFETCH_EXPIRY_PERIOD): at most that late.
            assert 0.5 <= trio.current_time() - start < 1.6
            assert len(results) == 2


@trio_test
async def test_an_unreachable_hub_fails_the_client_start(export_dir: Path) -> None:
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        hub.stop()
    start = trio.current_time()
    with pytest.raises(HubUnavailable):
        await HubClient(LOCALHOST, hub.port, connect_timeout=0.3).run()
    assert 0.25 <= trio.current_time() - start < 1.3


@trio_test
async def test_replies_that_keep_failing_their_checksum_raise_checksum_error(
        export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    failures = metric("neuralcache_checksum_failures_total")
    corrupted = 0

    async def corrupt_all(msg: Message) -> Message:
        nonlocal corrupted
        if isinstance(msg, ReadReply) and msg.data:
            corrupted += 1
            return flip_reply(msg)
        return msg

    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, corrupt_all)
        await nursery.start(proxy.serve)
        async with running_client(proxy.port) as client:
            with pytest.raises(ChecksumError):
                await client.read(big.file_id, big.version, 4, 1, deadline=trio.current_time() + 2)
        nursery.cancel_scope.cancel()
    # One bad block per corrupted reply the client took in (the flip hits one block of a
    # one-block read): the read gave up after CHECKSUM_ATTEMPTS of them, and each attempt is
    # hedged, so a twin copy may have come in (and counted) too.
    counted = metric("neuralcache_checksum_failures_total") - failures
    assert CHECKSUM_ATTEMPTS <= counted <= corrupted <= 2 * CHECKSUM_ATTEMPTS


@trio_test
async def test_one_corrupted_reply_is_refetched_and_the_read_succeeds(export_dir: Path) -> None:
    failures = metric("neuralcache_checksum_failures_total")
    corrupt_first = CorruptFirst(ReadReply)

    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, corrupt_first)
        await nursery.start(proxy.serve)
        async with running_client(proxy.port) as client:
            await read_and_check(client, export_dir, BIG, 10, 16)
            # The read is hedged: the corrupted copy may come in after its twin served it, and
            # is counted then (with a 5 s bound, so a copy never counted fails the test).
            with trio.fail_after(5):
                while metric("neuralcache_checksum_failures_total") < failures + 1:
                    await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert corrupt_first.corrupted == 1
    assert metric("neuralcache_checksum_failures_total") == failures + 1


@trio_test
async def test_a_short_deadline_read_does_not_drop_the_shared_connection(export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    retries = metric("neuralcache_hub_fetch_retries_total")

    async def delay_replies(msg: Message) -> Message:
        # Both replies are held, so the patient read is still in flight when the other times out.
        if isinstance(msg, ReadReply):
            await trio.sleep(0.6 if msg.first == 7 else 0.4)
        return msg

    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, delay_replies)
        await nursery.start(proxy.serve)
        async with running_client(proxy.port) as client:
            async def impatient_read() -> None:
                with pytest.raises(HubUnavailable):  # its own deadline: expected
                    await client.read(big.file_id, big.version, 7, 1,
                                      deadline=trio.current_time() + 0.2)

            async with trio.open_nursery() as readers:
                readers.start_soon(impatient_read)
                readers.start_soon(read_and_check, client, export_dir, BIG, 20, 1, 5.0)
            # What must not happen is collateral damage to the other request and the connection
            # (the pool may have dialled more connections, but none may have been dropped).
            assert proxy.closed == 0
        nursery.cancel_scope.cancel()
    assert metric("neuralcache_hub_fetch_retries_total") == retries


@trio_test
async def test_a_silent_hub_during_reconnect_is_retried(export_dir: Path) -> None:
    async def hold_forever(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        try:
            async with running_client(hub.port, connect_timeout=0.3) as client:
                hub.stop()
                await trio.sleep(0.1)
                async with trio.open_nursery() as silent:
                    listeners = await trio.open_tcp_listeners(hub.port, host=LOCALHOST)
                    silent.start_soon(trio.serve_listeners, hold_forever, listeners)
                    await trio.sleep(1.0)  # several dial attempts time out on the hello
                    silent.cancel_scope.cancel()  # closes the listeners and held connections
                hub = await start_hub(nursery, export_dir, port=hub.port)
                await read_and_check(client, export_dir, BIG, 0, 1, timeout=5)
        except* trio.TooSlowError:
            pytest.fail("trio.TooSlowError escaped HubClient.run during a reconnect")
        nursery.cancel_scope.cancel()


class FaultyExport(Export):
    """An export whose reads of block 666 fail in a way no one planned for."""

    def read_blocks(self, file_id: int, version: int, first: int, count: int, *,
                    nowait: bool = False) -> bytes | bytearray:
        if first == 666:
            raise RuntimeError("injected fault")
        return super().read_blocks(file_id, version, first, count, nowait=nowait)


@trio_test
async def test_an_unexpected_error_in_one_request_does_not_stop_the_hub(export_dir: Path) -> None:
    big = entry(export_dir, BIG)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, FaultyExport(str(export_dir)))
        async with running_client(hub.port) as bystander, running_client(hub.port) as victim:
            with pytest.raises((RemoteError, HubUnavailable)):
                await victim.read(big.file_id, big.version, 666, 1,
                                  deadline=trio.current_time() + 1)
            await read_and_check(bystander, export_dir, BIG, 0, 2)
        async with running_client(hub.port) as newcomer:
            await read_and_check(newcomer, export_dir, BIG, 2, 2)
        hub.stop()


class PollerSteps(trio.abc.Instrument):
    """Counts the runs of the client's arrival poller task."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("._arrival_poller"):
            self.steps += 1


@trio_test
async def test_arrivals_are_polled_while_the_hub_reports_loss_and_not_once_it_stops(
        export_dir: Path) -> None:
    steps = PollerSteps()
    trio.lowlevel.add_instrument(steps)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, ReportLoss())
        await nursery.start(proxy.serve)
        async with running_client(proxy.port) as client:
            client._resends = ResendRate(window=0.3, bucket=0.1)  # loss forgotten in 0.4 s
            await trio.sleep(0.1)
            idle = steps.steps
            await trio.sleep(0.2)
            assert steps.steps == idle  # no loss reported yet: nothing to poll for
            await read_and_check(client, export_dir, BIG, 0, 8)
            await trio.sleep(0.1)
            assert steps.steps > idle + 5  # polling every ARRIVAL_POLL_PERIOD
            await trio.sleep(0.8)  # the last report is out of the window
            quiet = steps.steps
            await trio.sleep(0.3)
            assert steps.steps == quiet
            await read_and_check(client, export_dir, BIG, 8, 8)
            await trio.sleep(0.1)
            assert steps.steps > quiet + 5  # a new report starts it again
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_path_that_loses_segments_after_start_up_gets_more_bulk_connections(
        export_dir: Path) -> None:
    """Every reply through the proxy reports a resent segment, so the controller's start-up
    ends and the loss goes on after it: the client left to choose grows its bulk pool to
    LOSSY_PATH_CONNECTIONS; one given a count keeps it. (On a clean loopback path the pool
    stays at the default: ``test_the_client_dials_the_pool_its_path_wants``.) No stagger: a
    greeting through the proxy on a loaded machine can take the 5 ms that spreads the first
    slots' dials over seconds (``stagger_step``), which is not what this test is about."""
    big = entry(export_dir, BIG)

    def bulk(client: HubClient) -> int:
        return sum(c.role == Role.BULK for c in client._conns)

    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, ReportLoss())
        await nursery.start(proxy.serve)
        async with running_client(proxy.port, stagger=0.0) as chosen, \
                running_client(proxy.port, connections=2, stagger=0.0) as fixed:
            for client in (chosen, fixed):
                client._steady_loss = SteadyLoss(settle=0.1)
            assert bulk(chosen) <= DEFAULT_CONNECTIONS
            with trio.fail_after(20):
                first = 0
                while bulk(chosen) < LOSSY_PATH_CONNECTIONS or bulk(fixed) < 2:
                    for client in (chosen, fixed):
                        data = await client.read(big.file_id, big.version, first, 8,
                                                 priority="prefetch",
                                                 deadline=trio.current_time() + 5)
                        assert data == blocks_of(export_dir, BIG, first, 8)
                    first = (first + 8) % 256
            assert chosen._steady_loss.lossy(trio.current_time())
            assert fixed._steady_loss.lossy(trio.current_time())
            await trio.sleep(0.3)  # a slot past the second would have dialled by now
            assert bulk(fixed) == 2
            assert bulk(chosen) == LOSSY_PATH_CONNECTIONS
        nursery.cancel_scope.cancel()


@trio_test
async def test_the_controller_counts_what_reached_the_kernel_on_every_connection(
        export_dir: Path) -> None:
    """Demand and prefetch replies alike: BBR caps its bandwidth samples by these counts while
    the hub reports loss, so a connection left out would make the cap too low."""
    e = entry(export_dir, BIG)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port) as client:
            sampler = client._pipe.controller.sampler
            await read_and_check(client, export_dir, BIG, 0, 8)
            demand = sampler.arrived
            assert demand >= 8 * BLOCK_SIZE
            got = await client.read(e.file_id, e.version, 8, 200, priority="prefetch",
                                    deadline=trio.current_time() + 2.0)
            assert got == blocks_of(export_dir, BIG, 8, 200)
            assert sampler.arrived - demand >= 200 * BLOCK_SIZE
        nursery.cancel_scope.cancel()


def _hub_side_tcp_info(port: int) -> dict[int, str]:
    """``ss``'s TCP info line for each connection the hub listening on ``port`` has accepted,
    by the spoke's port (the hub's sockets are not reachable from here)."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    # Each connection is a line of addresses, then an indented line of its TCP info.
    return {int(addresses.split()[-1].rpartition(":")[2]): info
            for addresses, info in zip(out[::2], out[1::2])}


def _hub_side_congestion(port: int) -> dict[int, str]:
    """The congestion control of each hub-side connection (the info line starts with it)."""
    return {spoke: info.split()[0] for spoke, info in _hub_side_tcp_info(port).items()}


_SS_RATE = re.compile(r"([\d.]+)([KMG]?)bps")
_SS_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}


def _hub_side_pacing_caps(port: int) -> dict[int, float | None]:
    """The cap on the kernel's pacing (bytes/s) of each hub-side connection, None where there
    is none (``ss`` prints a capped pacing rate as RATE/CAP, in bits per second)."""
    caps: dict[int, float | None] = {}
    for spoke, info in _hub_side_tcp_info(port).items():
        found = re.search(r"pacing_rate \S+/(\S+)", info)
        rate = _SS_RATE.fullmatch(found.group(1)) if found else None
        caps[spoke] = float(rate.group(1)) * _SS_UNITS[rate.group(2)] / 8 if rate else None
    return caps


@trio_test
async def test_the_hub_paces_bulk_replies_at_most_at_the_cap_the_spoke_sends(
        export_dir: Path) -> None:
    """The spoke's controller sets the rate: with its first prefetch request on a bulk
    connection the spoke sends a cap (``PacingLimit``), and the hub's kernel paces that
    connection's replies at most at it; demand connections are left uncapped."""
    e = entry(export_dir, BIG)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port) as client:
            await read_and_check(client, export_dir, BIG, 0, 8)
            got = await client.read(e.file_id, e.version, 8, 200, priority="prefetch",
                                    deadline=trio.current_time() + 5.0)
            assert got == blocks_of(export_dir, BIG, 8, 200)
            caps = _hub_side_pacing_caps(hub.port)
            sent = {c.stream.socket.getsockname()[1]: c.pacing_limit for c in client._conns}
            capped = [port for port, limit in sent.items() if limit is not None]
            assert capped  # the prefetch read went out on a bulk connection, with a cap
            for port, limit in sent.items():
                if limit is None:
                    assert caps[port] is None
                else:
                    assert caps[port] == pytest.approx(limit, rel=0.01)
            assert all(c.role == Role.BULK for c in client._conns
                       if c.stream.socket.getsockname()[1] in capped)
        hub.stop()


@trio_test
async def test_demand_connections_are_not_paced_at_either_end(export_dir: Path) -> None:
    """BBR paces a demand connection's few-segment replies at what they measure (a few KB per
    round trip); both ends of a demand connection run ``DEMAND_CONGESTION`` instead, told by
    the hello's role, and bulk connections keep the spoke's choice."""
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with running_client(hub.port) as client:
            await read_and_check(client, export_dir, BIG, 0, 8)
            conns = {c.stream.socket.getsockname()[1]: c for c in client._conns}
            hub_side = _hub_side_congestion(hub.port)
            roles = {c.role for c in conns.values()}
            assert roles == {Role.BULK, Role.DEMAND}
            for port, conn in conns.items():
                spoke_side = tcp.configure(conn.stream, None)  # reads it, changes nothing
                assert hub_side[port] == spoke_side
                if conn.role == Role.DEMAND:
                    assert spoke_side == tcp.DEMAND_CONGESTION
                elif "bbr" in tcp.available_congestion_controls():
                    assert spoke_side == "bbr"
        hub.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="loading nc_paced needs root")
@trio_test
async def test_a_hub_running_nc_paced_paces_bulk_replies_at_the_cap_and_demand_on_cubic(
        export_dir: Path) -> None:
    """Under ``nc_paced`` a bulk connection's replies go at the cap the spoke sent (the
    kernel's pacing rate is the cap, not at most it); demand connections keep CUBIC."""
    kernel_cc.load()
    e = entry(export_dir, BIG)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir, tcp_congestion=kernel_cc.NAME)
        async with running_client(hub.port) as client:
            await read_and_check(client, export_dir, BIG, 0, 8)
            await client.read(e.file_id, e.version, 8, 200, priority="prefetch",
                              deadline=trio.current_time() + 5.0)
            hub_side = _hub_side_congestion(hub.port)
            info = _hub_side_tcp_info(hub.port)
            for conn in client._conns:
                port = conn.stream.socket.getsockname()[1]
                if conn.role == Role.DEMAND:
                    assert hub_side[port] == tcp.DEMAND_CONGESTION
                    continue
                assert hub_side[port] == kernel_cc.NAME
                if conn.pacing_limit is not None:
                    rate, cap = re.search(r"pacing_rate (\S+)/(\S+)", info[port]).groups()
                    assert rate == cap  # paced at the cap itself
            assert any(c.pacing_limit is not None for c in client._conns)
        hub.stop()


def test_a_stream_that_is_not_a_socket_keeps_its_options() -> None:
    """The hub configures every connection's TCP by its role; a stream with no socket options
    (an in-memory one) is served as it is."""
    assert tcp.configure(object(), "bbr") is None
