"""The data path: sans-IO pieces (fair queue, request pipe, arrival tracker, framing) on their
own, then hub and client over real loopback sockets, and one run over an emulated WAN link.

Timing goals live in bench/transport.py; the few time-dependent checks here are orderings or
ratios with wide margins.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import random
import shutil
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric import checksum
from fabric.client import (BULK_STAGGER, DEFAULT_CONNECTIONS, DEFAULT_DEMAND_CONNECTIONS,
                           HEDGE_COPIES, HEDGE_MAX_BLOCKS, LONG_PATH_CONNECTIONS, LONG_PATH_RTT,
                           HubClient, _Connection, _Sent, adjacent_runs, bulk_connections,
                           demand_copies, stagger_step)
from fabric.congestion import CongestionStats, create_controller
from fabric.congestion.base import SampledController
from fabric.export import Export, WouldBlock
from fabric.protocol import (MAX_READ_RANGES, PROTOCOL_VERSION, ErrorReply, FrameDecoder, Hello,
                             Message, Priority, ProtocolError, ReadReply, ReadRequest, Role,
                             Welcome, decode_payload, encode)
from fabric.transport.arrivals import ArrivalCount, ArrivalTracker, TcpCounters
from fabric.transport.fair_queue import FairQueue
from fabric.transport.resend_rate import (BUCKET_S, LOSSY_RESENT_RATIO, RESEND_WINDOW_S,
                                          SETTLE_ROUNDS, SETTLE_S, STEADY_MIN_RESENT,
                                          ResendRate, SteadyLoss)
from fabric.transport.framing import FrameReader, read_reply_frame, read_reply_size, send_frame
from fabric.transport.request_pipe import (MAX_HEADROOM, MAX_LOSS_HEADROOM, MAX_REQUEST_BYTES,
                                           MIN_HEADROOM, MIN_REQUEST_BYTES, Chunk, RequestPipe,
                                           chunk_bytes, headroom)
from neuralcache.blocks import BLOCK_SIZE
from tests.fabric_helpers import LOCALHOST, Proxy, metric, start_hub, trio_test


REPO = Path(__file__).resolve().parent.parent


# -- protocol: the priority extension ---------------------------------------------------------

def test_priority_round_trips_and_a_version_1_request_is_demand() -> None:
    req = ReadRequest(7, 1, 2, 3, 4, Priority.PREFETCH)
    assert decode_payload(encode(req)[4:]) == req
    assert ReadRequest(7, 1, 2, 3, 4).priority == Priority.DEMAND
    v1 = msgpack.packb([ReadRequest.KIND, 7, 1, 2, 3, 4])  # what a version-1 spoke sends
    assert decode_payload(v1, version=1) == ReadRequest(7, 1, 2, 3, 4, Priority.DEMAND)
    with pytest.raises(ProtocolError):
        decode_payload(v1)  # five fields are not a version-2 request
    with pytest.raises(ProtocolError):
        decode_payload(msgpack.packb([ReadRequest.KIND, 7, 1, 2, 3, 4, 2]))  # no such priority


# -- fair queue ---------------------------------------------------------------------------------

def test_demand_is_served_before_any_queued_prefetch() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push("a", Priority.PREFETCH, 1 << 20, f"a-prefetch-{i}")
    q.push("b", Priority.DEMAND, 4096, "b-demand")
    q.push("a", Priority.DEMAND, 4096, "a-demand")
    assert [q.pop(), q.pop()] == ["b-demand", "a-demand"]
    assert q.pop() == "a-prefetch-0"
    assert len(q) == 4


@settings(max_examples=50, deadline=None)
@given(costs_a=st.lists(st.integers(1, 4 << 20), min_size=60, max_size=60),
       costs_b=st.lists(st.integers(1, 4 << 20), min_size=60, max_size=60))
def test_two_flooding_spokes_get_equal_bytes_within_one_request(
        costs_a: list[int], costs_b: list[int]) -> None:
    q: FairQueue[tuple[str, int]] = FairQueue()
    for ca, cb in zip(costs_a, costs_b):
        q.push("a", Priority.PREFETCH, ca, ("a", ca))
        q.push("b", Priority.PREFETCH, cb, ("b", cb))
    served = {"a": 0, "b": 0}
    while min(served.values()) < 40 << 20 and len(q) > 0:  # while both still have work
        spoke, cost = q.pop()  # type: ignore[misc]
        served[spoke] += cost
        if served["a"] >= sum(costs_a) or served["b"] >= sum(costs_b):
            break
        # DRR: neither is ever ahead by more than one quantum plus one request.
        assert abs(served["a"] - served["b"]) <= (256 << 10) + (4 << 20)


def test_a_withdrawn_request_is_not_served_and_an_idle_spoke_keeps_no_credit() -> None:
    q: FairQueue[str] = FairQueue(quantum=100)
    q.push("a", Priority.PREFETCH, 50, "x")
    q.push("a", Priority.PREFETCH, 50, "y")
    assert q.remove("a", Priority.PREFETCH, "x")
    assert not q.remove("a", Priority.PREFETCH, "x")
    assert q.pop() == "y" and q.pop() is None
    q.push("b", Priority.PREFETCH, 200, "b1")
    q.push("c", Priority.PREFETCH, 100, "c1")
    assert [q.pop(), q.pop()] == ["c1", "b1"]  # c affords its request first, b after 2 rounds


# -- request pipe -------------------------------------------------------------------------------

def test_chunks_grow_with_the_rate_between_the_bounds() -> None:
    assert chunk_bytes(1e6) == MIN_REQUEST_BYTES
    assert chunk_bytes(1e12) == MAX_REQUEST_BYTES
    middle = chunk_bytes(100e6)
    assert MIN_REQUEST_BYTES < middle < MAX_REQUEST_BYTES and middle % BLOCK_SIZE == 0
    # On a lossy path chunks stay small: a chunk waits for its slowest segment.
    lossy = chunk_bytes(100e6, lossy=True)
    assert MIN_REQUEST_BYTES < lossy < middle and lossy % BLOCK_SIZE == 0
    assert chunk_bytes(1e6, lossy=True) == MIN_REQUEST_BYTES


def test_headroom_is_the_timing_noise_over_the_round_trip() -> None:
    assert headroom(math.inf) == MIN_HEADROOM
    assert headroom(0.9) == MIN_HEADROOM
    assert MIN_HEADROOM < headroom(0.06) < MAX_HEADROOM
    assert headroom(0.0001) == MAX_HEADROOM


def test_headroom_leaves_room_for_what_the_hub_resends() -> None:
    """A long path that resends 1 % paces 1 % lower; a start-up's overflow counts only up to
    MAX_LOSS_HEADROOM; on a short path the timing noise already holds the share."""
    assert headroom(0.9, 0.01) == pytest.approx(MIN_HEADROOM + 0.01)
    assert headroom(0.9, 0.17) == pytest.approx(MIN_HEADROOM + MAX_LOSS_HEADROOM)
    assert headroom(math.inf, 0.01) == pytest.approx(MIN_HEADROOM + 0.01)
    assert headroom(0.06, 0.01) == headroom(0.06)
    pipe = RequestPipe(create_controller("bbr"))
    pipe.submit("a", 0, 4096)
    pipe.poll(0.0)
    clean = pipe.rate
    pipe.poll(0.0, 0.01)
    assert pipe.headroom == headroom(pipe.stats().min_rtt, 0.01)
    assert pipe.rate == pytest.approx(clean * (1 - pipe.headroom) / (1 - headroom(math.inf)))


def test_prefetch_is_cut_into_chunks_and_waits_for_the_window() -> None:
    pipe = RequestPipe(create_controller("bbr"))
    pipe.submit("job", 0, 10_000)
    now, sent = 1000.0, []
    while True:
        out = pipe.poll(now)
        if out is None:
            break
        if isinstance(out, float):
            assert out > now
            now = out
            continue
        sent.append(out)
    assert sent and all(isinstance(c, Chunk) and len(c.pieces) == 1 for c in sent)
    assert all(c.pieces[0][0] == "job" for c in sent)
    assert [c.pieces[0][1] for c in sent] == list(
        itertools_accumulate([0] + [c.count for c in sent]))[:-1]
    assert pipe.stats().bytes_in_flight >= pipe.stats().cwnd  # stopped by the window...
    assert pipe.queued_bytes == (10_000 - sum(c.count for c in sent)) * BLOCK_SIZE
    pipe.on_acked(now + 0.05, sent[0].packet_id)  # ...and an ack opens it again
    assert isinstance(pipe.poll(now + 0.05), (Chunk, float))


def itertools_accumulate(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def test_demand_is_charged_to_the_pacer_but_not_to_the_window() -> None:
    pipe = RequestPipe(create_controller("bbr"))
    pipe.submit("job", 0, 64)
    first = pipe.poll(5000.0)
    assert isinstance(first, Chunk)
    in_flight = pipe.stats().bytes_in_flight
    pipe.send_demand(5000.0, 4 << 20)  # a large demand read, sent at once
    assert pipe.stats().bytes_in_flight == in_flight
    later = pipe.poll(5000.0)
    assert isinstance(later, float) and later > 5000.0  # the next prefetch waits its turn


def _share_a_link_with_demand(seconds: float, rate: float, rtt: float,
                              demand_rate: float) -> tuple[RequestPipe, float]:
    """Run a pipe with endless prefetch over a FIFO bottleneck of ``rate`` bytes/s that it
    shares with hedged demand reads (two 128 KiB copies each) worth ``demand_rate`` bytes/s,
    sent regardless of the pacer as the client sends them. Returns the pipe and the prefetch
    bytes/s delivered."""
    demand_bytes, copies = 128 * 1024, 2
    period = copies * demand_bytes / demand_rate
    pipe = RequestPipe(create_controller("bbr", seed=1))
    pipe.submit("job", 0, 10**9)
    link_free = 0.0
    events: list[tuple[float, int, str, Any]] = [(0.0, 0, "demand", None)]
    order = itertools.count(1)

    def transmit(t: float, nbytes: int) -> float:
        """When a reply requested at ``t`` has fully arrived: half a round trip to the hub, the
        bottleneck queue and serialization, half a round trip back."""
        nonlocal link_free
        link_free = max(link_free, t + rtt / 2) + nbytes / rate
        return link_free + rtt / 2

    prefetched = 0
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if t > seconds:
            break
        if kind == "ack":
            pipe.on_acked(t, payload.packet_id)
            prefetched += payload.nbytes
        elif kind == "demand_reply":
            pipe.on_demand_delivered(t, payload)
        elif kind == "demand":
            for _ in range(copies):
                pipe.send_demand(t, demand_bytes)
                heapq.heappush(events, (transmit(t, demand_bytes), next(order), "demand_reply",
                                        demand_bytes))
            heapq.heappush(events, (t + period, next(order), "demand", None))
        out = pipe.poll(t)
        while isinstance(out, Chunk):
            heapq.heappush(events, (transmit(t, out.nbytes), next(order), "ack", out))
            out = pipe.poll(t)
        if isinstance(out, float):
            heapq.heappush(events, (out, next(order), "poll", None))
    return pipe, prefetched / seconds


def test_demand_on_the_path_neither_shrinks_the_model_nor_stops_prefetch() -> None:
    """Demand takes 40 % of a 200 Mbit/s, 60 ms link. Were its replies left out of the delivery
    rate, the estimate would sink toward the prefetch share, the pacer (charged for demand
    too) would give prefetch less and less, and prefetch would stop within seconds."""
    rate = 25e6
    pipe, prefetch_rate = _share_a_link_with_demand(10.0, rate, 0.06, demand_rate=0.4 * rate)
    assert pipe.stats().btl_bw == pytest.approx(rate, rel=0.1)
    assert prefetch_rate >= 0.5 * rate  # most of the 60 % that demand leaves


def test_a_clock_that_does_not_start_at_zero_does_not_trigger_probe_rtt() -> None:
    pipe = RequestPipe(create_controller("bbr"))
    pipe.submit("job", 0, 16)
    now = 123_456.0  # trio's clock has a random offset like this
    chunk = pipe.poll(now)
    assert isinstance(chunk, Chunk)
    pipe.on_acked(now + 0.06, chunk.packet_id)
    assert pipe.stats().state == "startup"


def test_cancel_and_requeue() -> None:
    pipe = RequestPipe(create_controller("cubic"))
    pipe.submit("a", 0, 32)
    pipe.submit("b", 100, 32)
    pipe.cancel("a")
    assert pipe.queued_bytes == 32 * BLOCK_SIZE
    pipe.requeue("a", 5, 3)  # a lost chunk goes first
    chunk = pipe.poll(10.0)
    assert isinstance(chunk, Chunk) and chunk.pieces[0] == ("a", 5, 3)


def _drain(pipe: RequestPipe) -> list[tuple[str, int]]:
    """Every queued block as (job, block), in the order the pipe sends them (each chunk acked
    a millisecond later, so the window never holds the queue back)."""
    now, out = 10.0, []
    while (chunk := pipe.poll(now)) is not None:
        if isinstance(chunk, float):
            now = chunk
            continue
        out.extend((job, b) for job, first, count in chunk.pieces
                   for b in range(first, first + count))
        now += 0.001
        pipe.on_acked(now, chunk.packet_id)
    return out


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 50),
                                  st.integers(1, 20)), max_size=8),
       jobs=st.sets(st.sampled_from("abc")), first=st.integers(0, 60),
       length=st.integers(0, 40), cancelled=st.sampled_from("abcz"))
def test_take_removes_the_wanted_queued_blocks_and_keeps_the_rest_in_order(
        entries: list[tuple[str, int, int]], jobs: set[str], first: int, length: int,
        cancelled: str) -> None:
    """Against a reference model: the queue as a list of (job, block)."""
    pipe = RequestPipe(create_controller("cubic"))
    model = []
    for job, lo, count in entries:
        pipe.submit(job, lo, count)
        model.extend((job, b) for b in range(lo, lo + count))
    pieces = pipe.take(jobs.__contains__, first, first + length)
    wanted = [(j, b) for j, b in model if j in jobs and first <= b < first + length]
    assert [(j, b) for j, lo, n in pieces for b in range(lo, lo + n)] == wanted
    rest = [(j, b) for j, b in model if not (j in jobs and first <= b < first + length)]
    assert pipe.queued_bytes == len(rest) * BLOCK_SIZE
    pipe.cancel(cancelled)  # the per-job bookkeeping survived the splits
    assert _drain(pipe) == [jb for jb in rest if jb[0] != cancelled]


def test_small_jobs_share_a_chunk_up_to_its_size() -> None:
    """Sixteen-block chunks (the smallest, at a new controller's rate on a lossy path): four
    4-block jobs go as one request of four ranges; a 10-block job is cut where the chunk ends
    and its rest leads the next one."""
    pipe = RequestPipe(create_controller("bbr"))
    for job in "abcd":
        pipe.submit(job, 100, 4)
    pipe.submit("e", 0, 10)
    pipe.submit("f", 50, 2)
    first = pipe.poll(10.0, LOSSY_RESENT_RATIO)
    assert isinstance(first, Chunk)
    assert first.pieces == (("a", 100, 4), ("b", 100, 4), ("c", 100, 4), ("d", 100, 4))
    assert first.nbytes == MIN_REQUEST_BYTES
    pipe.on_acked(10.001, first.packet_id)
    second = pipe.poll(10.01, LOSSY_RESENT_RATIO)
    assert isinstance(second, Chunk) and second.pieces == (("e", 0, 10), ("f", 50, 2))
    assert pipe.queued_bytes == 0


class _FastPath(SampledController):
    """A controller with a fixed, fast pacing rate and an open window: chunks of
    ``MAX_REQUEST_BYTES``."""

    name = "fast"

    def __init__(self) -> None:
        super().__init__()
        self._cwnd = 1 << 40
        self._pacing_rate = 10e9

    def on_packet_sent(self, now: float, packet_id: int, nbytes: int) -> None:
        self.sampler.on_sent(now, packet_id, nbytes)

    def stats(self) -> CongestionStats:
        return self._stats(state="fast", starting=False, btl_bw=self._pacing_rate,
                           min_rtt=math.inf)


def test_a_chunk_carries_at_most_max_read_ranges() -> None:
    pipe = RequestPipe(_FastPath())
    for i in range(MAX_READ_RANGES + 5):
        pipe.submit(i, 0, 1)
    chunk = pipe.poll(10.0)
    assert isinstance(chunk, Chunk) and len(chunk.pieces) == MAX_READ_RANGES
    assert pipe.queued_bytes == 5 * BLOCK_SIZE


# -- arrival tracker ----------------------------------------------------------------------------

MSS = 1448


def _segments(sizes: list[int], ends: list[int]) -> list[tuple[list[int], int]]:
    """The replies' byte stream cut into full segments: for each, the replies it carries
    bytes of, and its length."""
    segs = []
    for start in range(0, ends[-1], MSS):
        stop = min(start + MSS, ends[-1])
        segs.append(([k for k, end in enumerate(ends) if end > start and end - sizes[k] < stop],
                     stop - start))
    return segs


def _simulate(sizes: list[int], lost: set[int], delay: int,
              tracker: ArrivalTracker) -> tuple[dict[int, int], dict[int, int]]:
    """The replies are one byte stream cut into full segments (the sender has them queued
    back to back, as under load), which arrive one per step; segment i in ``lost`` arrives
    ``delay`` steps late. The application reads in order. Returns, per reply, the step its
    last byte truly arrived and the step it was acked: reported by the tracker (which looks
    after every step) or completed by the application, whichever came first; checks on the
    way that the bytes acked never exceed the bytes that arrived."""
    ends = list(itertools_accumulate(sizes))
    segs = _segments(sizes, ends)
    for k, size in enumerate(sizes):
        tracker.expect(k, size)
    events: dict[int, list[int]] = {}
    for i in range(len(segs)):
        events.setdefault(i + (delay if i in lost else 0), []).append(i)
    missing = [0] * len(sizes)
    for replies, _ in segs:
        for k in replies:
            missing[k] += 1
    have = [False] * len(segs)
    truth: dict[int, int] = {}
    reported: dict[int, int] = {}
    in_order = received = arrived_segs = arrived_bytes = ooo = consumed = 0
    for step in sorted(events):
        for i in events[step]:
            have[i] = True
            arrived_segs += 1
            arrived_bytes += segs[i][1]
            ooo += i > in_order  # a hole lies before it
            for k in segs[i][0]:
                missing[k] -= 1
                if not missing[k]:
                    truth[k] = step
        while in_order < len(segs) and have[in_order]:
            received += segs[in_order][1]
            in_order += 1
        while consumed < len(sizes) and ends[consumed] <= received:
            tracker.completed(consumed, ends[consumed])
            reported.setdefault(consumed, step)
            consumed += 1
        for k in tracker.observe(TcpCounters(received, arrived_segs, ooo, MSS)):
            reported.setdefault(k, step)
        assert sum(sizes[k] for k in reported) <= arrived_bytes
    return truth, reported


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(64 << 10, 400 << 10), min_size=3, max_size=12),
       loss=st.floats(0, 0.05), delay=st.integers(5, 200), seed=st.integers(0, 1000))
def test_bytes_are_never_counted_before_they_arrive(
        sizes: list[int], loss: float, delay: int, seed: int) -> None:
    rng = random.Random(seed)
    total_segs = sum(-(-s // MSS) for s in sizes)
    lost = {i for i in range(total_segs) if rng.random() < loss}
    truth, reported = _simulate(sizes, lost, delay, ArrivalTracker())
    assert set(truth) == set(range(len(sizes)))


def test_replies_behind_a_hole_are_reported_as_they_arrive_not_when_it_fills() -> None:
    sizes = [64 << 10] * 10  # 453 segments, one per step
    delay = 2000  # the first segment's retransmission lands long after all the others
    truth, reported = _simulate(sizes, {0}, delay, ArrivalTracker())
    # In order, the application sees every reply only at step 2000. The tracker counts them
    # within a few steps of their arrival, but for the last one, which the fill's 1 %
    # under-count keeps until the hole is repaired.
    early = sorted(k for k, step in reported.items() if step < delay)
    assert early == list(range(9))
    assert all(reported[k] - truth[k] <= 10 for k in range(1, 9))


def test_without_loss_replies_are_reported_as_they_arrive() -> None:
    sizes = [100 << 10] * 5
    truth, reported = _simulate(sizes, set(), 0, ArrivalTracker())
    assert reported == truth


def test_the_arrival_count_is_the_segment_count_where_every_segment_is_counted() -> None:
    count = ArrivalCount()
    # A reply of 10 segments, 3 of them behind a hole: all count as they arrive ...
    assert count.update(TcpCounters(7 * MSS - 100, 10, 3, MSS)) == 10 * MSS
    # ... and the in-order bytes the repair releases are not counted twice.
    assert count.update(TcpCounters(10 * MSS - 100, 11, 3, MSS)) == MSS


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0, 1)), max_size=30))
def test_where_every_segment_is_counted_the_count_is_segments_times_their_size(
        looks: list[tuple[int, float]]) -> None:
    count, segments, in_order, total = ArrivalCount(), 0, 0, 0
    for new_segments, share in looks:
        segments += new_segments
        # In-order bytes grow, but never past what the segments could carry.
        in_order = max(in_order, int(segments * MSS * share))
        total += count.update(TcpCounters(in_order, segments, 0, MSS))
        assert total == segments * MSS


def test_the_arrival_count_keeps_up_with_a_receiver_that_coalesces_bursts() -> None:
    # A coalescing receiver (a virtio-net guest's receive offload, the WAN emulator's TUN
    # devices) counts a burst of 44 segments as one.
    count, burst = ArrivalCount(), 44 * MSS
    assert [count.update(TcpCounters(burst * n, n, 0, MSS)) for n in range(1, 4)] == [burst] * 3
    assert count.update(TcpCounters(burst * 3, 3, 0, MSS)) == 0  # nothing new


# -- framing and checksums ------------------------------------------------------------------

@pytest.mark.parametrize("count", [1, 16, 255, 1024])
def test_scatter_gather_reply_frames_equal_encode(count: int) -> None:
    data = random.Random(count).randbytes(count * BLOCK_SIZE)
    sums = checksum.range_checksums(data)
    for req_id, first in [(1, 0), (300, 2**40), (2**63, 5)]:
        wire = encode(ReadReply(req_id, first, data, sums))
        assert b"".join(read_reply_frame(req_id, first, data, sums)) == wire
        assert read_reply_size(req_id, first, count) == len(wire)
        for resent in (0, 1448, 2**40):  # protocol 3: the hub's retransmitted count at the end
            wire = encode(ReadReply(req_id, first, data, sums, resent))
            assert b"".join(read_reply_frame(req_id, first, data, sums, resent)) == wire
            assert decode_payload(wire[4:]) == ReadReply(req_id, first, data, sums, resent)
            # The size the arrival tracker expects may exceed the frame, never fall short.
            assert 0 <= read_reply_size(req_id, first, count, loss_report=True) - len(wire) <= 8


@trio_test
async def test_frame_reader_reads_any_chunking_of_small_and_large_frames() -> None:
    rng = random.Random(1)
    msgs = [ReadReply(i, i, rng.randbytes(size), b"") for i, size in
            enumerate([0, 10, 200_000, 3 << 20, 5, 1 << 20])]
    wire = b"".join(encode(m) for m in msgs)
    send, receive = trio.testing.memory_stream_one_way_pair()
    reader = FrameReader(receive)

    async def feed() -> None:
        pos = 0
        while pos < len(wire):
            n = rng.randint(1, 300_000)
            await send.send_all(wire[pos:pos + n])
            pos += n
        await send.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed)
        got = [await reader.receive() for _ in msgs]
        assert await reader.receive() is None
    assert got == msgs
    assert reader.consumed == len(wire)


@trio_test
async def test_frame_reader_refuses_a_truncated_frame() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    await send.send_all(encode(Hello(2, "x"))[:-1])
    await send.aclose()
    with pytest.raises(ProtocolError):
        await FrameReader(receive).receive()


@trio_test
async def test_send_frame_over_a_socket_with_sendmsg() -> None:
    a, b = trio.socket.socketpair()
    data = random.Random(2).randbytes(2 << 20)
    frame = read_reply_frame(9, 3, data, checksum.range_checksums(data))
    reader = FrameReader(trio.SocketStream(b))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_frame, trio.SocketStream(a), frame)
        msg = await reader.receive()
    assert isinstance(msg, ReadReply) and msg.data == data and msg.req_id == 9


@trio_test
async def test_a_large_frame_wakes_its_reader_for_no_byte_beyond_it() -> None:
    """A large frame is received with SO_RCVLOWAT raised, so that its reader wakes less often.
    The wait is never for more than the frame still owes (here the sender sends nothing more
    and keeps the connection open), and it is back to 1 for the next frame's header."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    data = random.Random(3).randbytes(3 << 20)
    wire = encode(ReadReply(1, 0, data, b""))
    reader = FrameReader(client)
    try:
        async with trio.open_nursery() as nursery:
            async def send_in_two_pieces() -> None:
                await server.send_all(wire[:len(wire) - 1000])
                await trio.sleep(0.2)
                await server.send_all(wire[len(wire) - 1000:])

            nursery.start_soon(send_in_two_pieces)
            with trio.fail_after(10):
                msg = await reader.receive()
        assert isinstance(msg, ReadReply) and msg.data == data
        assert client.socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        await server.send_all(encode(Hello(6, "next")))
        with trio.fail_after(10):
            assert await reader.receive() == Hello(6, "next")
    finally:
        for stream in (client, server, *listeners):
            await stream.aclose()


# -- hub and client over loopback -------------------------------------------------------------

class SlowExport(Export):
    """Every read takes ``delay`` seconds (a slow disk), so the hub's read slots are the
    bottleneck and its queueing order is what a test observes."""

    delay = 0.02

    def read_blocks(self, file_id: int, version: int, first: int, count: int, *,
                    nowait: bool = False) -> bytes | bytearray:
        if nowait:
            raise WouldBlock("a slow disk always waits")
        time.sleep(self.delay)
        return super().read_blocks(file_id, version, first, count)


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    root = tmp_path / "export"
    root.mkdir()
    (root / "big.bin").write_bytes(random.Random(3).randbytes(3000 * BLOCK_SIZE))
    return root


def big(root: Path) -> Any:
    return next(e for e in Export(str(root)).scan() if e.path == "big.bin")


def blocks_of(root: Path, first: int, count: int) -> bytes:
    return (root / "big.bin").read_bytes()[first * BLOCK_SIZE:(first + count) * BLOCK_SIZE]


async def started_client(nursery: trio.Nursery, port: int, **kwargs: Any) -> HubClient:
    kwargs.setdefault("connect_timeout", 2.0)
    kwargs.setdefault("stagger", 0.0)
    client = HubClient(LOCALHOST, port, **kwargs)
    await nursery.start(client.run)
    with trio.fail_after(5):  # the pool dials in parallel; wait until all of it is up
        while len(client._conns) < kwargs.get("connections", DEFAULT_CONNECTIONS) + \
                kwargs.get("demand_connections", DEFAULT_DEMAND_CONNECTIONS):
            await trio.sleep(0.01)
    return client


@trio_test
async def test_prefetch_reads_of_any_size_are_split_and_reassembled(export_dir: Path) -> None:
    e = big(export_dir)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        client = await started_client(nursery, hub.port)
        for first, count in [(0, 1), (7, 300), (100, 2900)]:  # 2900 > MAX_READ_BLOCKS
            data = await client.read(e.file_id, e.version, first, count,
                                     deadline=trio.current_time() + 10, priority="prefetch")
            assert data == blocks_of(export_dir, first, count)
        with pytest.raises(ValueError):
            await client.read(e.file_id, e.version, 0, 1, deadline=trio.current_time() + 1,
                              priority="urgent")
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_demand_read_overtakes_a_pipe_full_of_prefetch(export_dir: Path) -> None:
    e = big(export_dir)
    done: list[str] = []
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, SlowExport(str(export_dir)), read_slots=1)
        client = await started_client(nursery, hub.port)

        async def prefetch(i: int) -> None:
            await client.read(e.file_id, e.version, i * 64, 64,
                              deadline=trio.current_time() + 15, priority="prefetch")
            done.append(f"prefetch-{i}")

        async with trio.open_nursery() as readers:
            for i in range(40):
                readers.start_soon(prefetch, i)
            await trio.sleep(0.3)  # the hub's queue is now deep in prefetch
            started = trio.current_time()
            data = await client.read(e.file_id, e.version, 2999, 1,
                                     deadline=trio.current_time() + 5)
            demand_latency = trio.current_time() - started
            done.append("demand")
            assert data == blocks_of(export_dir, 2999, 1)
        nursery.cancel_scope.cancel()
    # Served ahead of the queue: a few prefetch reads' time (each costs >= 20 ms at the hub),
    # not the whole queue's.
    assert done.index("demand") < 20
    assert demand_latency < 15 * SlowExport.delay


class RecordingExport(SlowExport):
    """A slow export that notes the first block of every read, in the order the hub read them."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: list[int] = []

    def read_blocks(self, file_id: int, version: int, first: int, count: int, *,
                    nowait: bool = False) -> bytes | bytearray:
        data = super().read_blocks(file_id, version, first, count, nowait=nowait)
        self.reads.append(first)
        return data


@trio_test
async def test_blocks_a_reader_needs_leave_the_prefetch_queue_as_demand(export_dir: Path) -> None:
    e = big(export_dir)
    export = RecordingExport(str(export_dir))
    expedited = metric("neuralcache_fabric_expedited_blocks_total")
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export, read_slots=1)
        client = await started_client(nursery, hub.port)
        got: list[bytes] = []

        async def prefetch() -> None:
            got.append(await client.read(e.file_id, e.version, 0, 2900, priority="prefetch",
                                         deadline=trio.current_time() + 30))

        async with trio.open_nursery() as readers:
            readers.start_soon(prefetch)
            await trio.sleep(0.2)  # the window is full; most of the read waits in the queue
            assert client.expedite(e.file_id, e.version, 2880, 10) == 10
            assert client.expedite(e.file_id, e.version, 2880, 10) == 0  # taken already
        nursery.cancel_scope.cancel()
    assert got == [blocks_of(export_dir, 0, 2900)]  # the pieces were put back together
    assert metric("neuralcache_fabric_expedited_blocks_total") - expedited == 10
    # The hub read the expedited blocks before prefetch chunks that were queued ahead of them.
    expedited_at = export.reads.index(2880)
    assert min(export.reads[expedited_at + 1:]) < 2880


def test_adjacent_runs_join_consecutive_pieces_up_to_one_request() -> None:
    a, b, c = object(), object(), object()
    pieces = [(b, 16, 16), (a, 0, 16), (c, 40, 8), (a, 32, 8)]
    assert adjacent_runs(pieces) == [[(a, 0, 16), (b, 16, 16), (a, 32, 8), (c, 40, 8)]]
    assert adjacent_runs([(a, 0, 16), (b, 20, 4)]) == [[(a, 0, 16)], [(b, 20, 4)]]
    big_pieces = [(a, i * 512, 512) for i in range(3)]  # 1536 blocks > MAX_READ_BLOCKS
    assert adjacent_runs(big_pieces) == [big_pieces[:2], big_pieces[2:]]


@trio_test
async def test_adjacent_queued_prefetch_reads_are_expedited_as_one_demand_request(
        export_dir: Path) -> None:
    """A reader's run that spans several queued prefetch reads costs one demand request, and
    each prefetch read still gets exactly its own blocks."""
    e = big(export_dir)
    demand = {"priority": "demand"}
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, SlowExport(str(export_dir)), read_slots=1)
        client = await started_client(nursery, hub.port)
        # Enough ahead to fill the window, so the last reads wait in the queue.
        for first in range(0, 2800, 200):
            client.start_prefetch(e.file_id, e.version, first, 200,
                                  deadline=trio.current_time() + 30, on_done=lambda _: None)
        done: dict[int, list] = {}
        for first in range(2800, 2880, 16):
            client.start_prefetch(e.file_id, e.version, first, 16,
                                  deadline=trio.current_time() + 30,
                                  on_done=lambda parts, first=first: done.__setitem__(first, parts))
        await trio.sleep(0.2)
        requests = metric("neuralcache_fabric_requests_total", demand)
        assert client.expedite(e.file_id, e.version, 2808, 56) == 56  # parts of 4 reads
        with trio.fail_after(10):
            while not all(first in done for first in range(2816, 2864, 16)):
                await trio.sleep(0.01)
        assert metric("neuralcache_fabric_requests_total", demand) - requests == 1
        for first in range(2816, 2864, 16):
            assert b"".join(done[first]) == blocks_of(export_dir, first, 16)
        nursery.cancel_scope.cancel()


@trio_test
async def test_one_spoke_cannot_starve_another(export_dir: Path) -> None:
    e = big(export_dir)
    finished: dict[str, list[float]] = {"greedy": [], "modest": []}
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, SlowExport(str(export_dir)), read_slots=1)
        greedy = await started_client(nursery, hub.port, name="greedy", connections=4)
        modest = await started_client(nursery, hub.port, name="modest", connections=1)

        async def reads(client: HubClient, name: str, n: int) -> None:
            async def one(i: int) -> None:
                await client.read(e.file_id, e.version, i * 16, 16, priority="prefetch",
                                  deadline=trio.current_time() + 15)
                finished[name].append(trio.current_time())
            async with trio.open_nursery() as inner:
                for i in range(n):
                    inner.start_soon(one, i)

        async with trio.open_nursery() as load:
            load.start_soon(reads, greedy, "greedy", 60)
            await trio.sleep(0.2)  # greedy has filled the hub's queue
            load.start_soon(reads, modest, "modest", 6)
        nursery.cancel_scope.cancel()
    # Round robin between spokes: modest's six reads finish while greedy still has most of
    # its sixty to go (FIFO would put all of greedy's queued reads first).
    modest_done = max(finished["modest"])
    assert sum(t < modest_done for t in finished["greedy"]) < 40


@trio_test
async def test_the_pool_its_hedged_demand_and_its_model_in_the_metrics(export_dir: Path) -> None:
    e = big(export_dir)
    demand_requests = metric("neuralcache_fabric_requests_total", {"priority": "demand"})
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        spokes = metric("neuralcache_hub_connected_spokes")
        client = await started_client(nursery, hub.port, connections=3, demand_connections=2)
        assert metric("neuralcache_fabric_connections", {"role": "bulk"}) == 3
        assert metric("neuralcache_fabric_connections", {"role": "demand"}) == 2
        assert metric("neuralcache_hub_connected_spokes") == spokes + 1  # one spoke, 5 sockets
        await client.read(e.file_id, e.version, 5, 1, deadline=trio.current_time() + 5)
        # Loopback loses nothing, so even a small demand read goes out once (no hedge).
        assert metric("neuralcache_fabric_requests_total",
                      {"priority": "demand"}) == demand_requests + 1
        assert metric("neuralcache_fabric_resent_ratio") == 0
        await client.read(e.file_id, e.version, 0, HEDGE_MAX_BLOCKS + 1,
                          deadline=trio.current_time() + 5)
        assert metric("neuralcache_fabric_requests_total",
                      {"priority": "demand"}) == demand_requests + 2
        # Demand replies count as delivered for the model, though they are none of its packets.
        assert client.stats().delivered_bytes >= (HEDGE_MAX_BLOCKS + 2) * BLOCK_SIZE
        assert client.stats().bytes_in_flight == 0
        for i in range(20):
            await client.read(e.file_id, e.version, i * 100, 100, priority="prefetch",
                              deadline=trio.current_time() + 5)
        stats = client.stats()
        assert stats.name == "bbr" and stats.delivered_bytes >= 2000 * BLOCK_SIZE
        assert stats.btl_bw > 0 and 0 < stats.min_rtt < 1
        assert metric("neuralcache_fabric_btl_bw_bytes_per_second") > 0
        assert metric("neuralcache_fabric_min_rtt_seconds") > 0
        assert metric("neuralcache_fabric_cwnd_bytes") == stats.cwnd
        assert metric("neuralcache_fabric_state", {"controller": "bbr", "state": stats.state}) == 1
        nursery.cancel_scope.cancel()


def test_small_demand_reads_are_hedged_only_while_the_path_loses_segments() -> None:
    assert demand_copies(1, False) == 1
    assert demand_copies(1, True) == HEDGE_COPIES
    assert demand_copies(HEDGE_MAX_BLOCKS, True) == HEDGE_COPIES
    assert demand_copies(HEDGE_MAX_BLOCKS + 1, True) == 1  # too large to send twice


def test_the_path_is_lossy_from_the_resent_share_on() -> None:
    for resent, lossy in ((0, False), (LOSSY_RESENT_RATIO / 2, False), (LOSSY_RESENT_RATIO, True)):
        rate = ResendRate()
        rate.on_delivered(0.0, 10**6)
        rate.on_resent(0.0, int(resent * 10**6))
        assert rate.lossy(0.5) is lossy


def test_a_second_copy_goes_on_a_busy_connection_when_only_one_is_idle() -> None:
    """Idle demand connections first; then busy ones, the one whose oldest request is
    youngest first (a copy behind a reply is late only if that reply lost a segment; a read
    sent once is late whenever it loses one)."""
    def conn(*sent_at: float) -> _Connection:
        c = _Connection(None, None, Role.DEMAND, 0.0)  # type: ignore[arg-type]
        for i, t in enumerate(sent_at):
            c.pending[i] = _Sent(i, None, BLOCK_SIZE, t)
        return c

    client = HubClient(LOCALHOST, 1)  # not running: no pool grows
    idle, older, younger = conn(), conn(1.0, 5.0), conn(3.0)
    client._conns = [older, idle, younger]
    assert client._pick_demand(1) == [idle]
    assert client._pick_demand(2) == [idle, younger]
    assert client._pick_demand(3) == [idle, younger, older]
    client._conns = [older, younger]
    assert client._pick_demand(2) == [younger, older]


def test_steady_loss_ignores_the_start_up_and_its_repairs() -> None:
    """A clean path's start-up overflows the bottleneck (every path's does): its resends, and
    those reported while it settles, never make the path lossy; 1 % loss after that does."""
    def feed(loss: SteadyLoss | ResendRate, start: float, stop: float, share: float) -> None:
        t = start
        while t < stop:  # 25 MB/s in 10 ms steps, ``share`` of it resent
            loss.on_delivered(t, 250_000)
            loss.on_resent(t, int(share * 250_000))
            t += 0.01

    clean, every = SteadyLoss(), ResendRate()
    clean.on_model(0.0, True, 0.06)
    for rate in (clean, every):
        feed(rate, 0.0, 1.5, 0.2)  # the start-up's tail drops
    clean.on_model(1.5, False, 0.06)
    for rate in (clean, every):
        feed(rate, 1.5, 1.5 + SETTLE_S, 0.05)  # their repairs, reported while it settles
        feed(rate, 1.5 + SETTLE_S, 6.0, 0.0)
    assert every.lossy(6.0)  # what the hedging sees: the start-up is still in its window
    assert not clean.lossy(6.0)

    lossy = SteadyLoss()
    lossy.on_model(0.0, True, 0.06)
    lossy.on_model(1.0, False, 0.06)
    assert not lossy.lossy(1.0)
    feed(lossy, 1.0, 1.0 + SETTLE_S + 0.5, 0.01)
    assert lossy.lossy(1.0 + SETTLE_S + 0.5)  # 0.5 s of 1 %: ~125 KB resent
    lossy.on_model(4.0, True, 0.06)  # a new start-up: counted afresh after it
    assert not lossy.lossy(4.0)


def test_steady_loss_wants_a_rate_and_more_than_a_stray_drop() -> None:
    few = SteadyLoss()
    few.on_model(0.0, False, 0.9)  # a long path settles over SETTLE_ROUNDS round trips
    settled = SETTLE_ROUNDS * 0.9
    assert settled > SETTLE_S
    few.on_resent(settled - 0.1, STEADY_MIN_RESENT)
    assert not few.lossy(settled)  # reported before it settled
    few.on_delivered(settled, 10**6)
    few.on_resent(settled, 2 * 1448)  # two drops: a ratio above the line, but two drops
    assert not few.lossy(settled)
    few.on_resent(settled, STEADY_MIN_RESENT)
    assert few.lossy(settled)
    rare = SteadyLoss(settle=0.0)
    rare.on_model(0.0, False, 0.06)
    rare.on_delivered(0.0, int(2 * STEADY_MIN_RESENT / LOSSY_RESENT_RATIO))
    rare.on_resent(0.0, STEADY_MIN_RESENT)  # half the share that counts as lossy
    assert not rare.lossy(0.0)


def test_bulk_connections_are_staggered_only_on_paths_where_it_ends_before_start_up() -> None:
    step = BULK_STAGGER / DEFAULT_CONNECTIONS
    assert stagger_step(BULK_STAGGER, DEFAULT_CONNECTIONS, 0.0001) == 0.0  # loopback
    assert stagger_step(BULK_STAGGER, DEFAULT_CONNECTIONS, 0.060) == step
    assert stagger_step(BULK_STAGGER, DEFAULT_CONNECTIONS, 0.300) == step
    assert stagger_step(BULK_STAGGER, DEFAULT_CONNECTIONS, 0.900) == 0.0  # 11 round trips
    assert stagger_step(0.0, DEFAULT_CONNECTIONS, 0.060) == 0.0


def test_a_long_path_gets_more_bulk_connections() -> None:
    assert bulk_connections(0.0001) == DEFAULT_CONNECTIONS  # loopback
    assert bulk_connections(0.060) == DEFAULT_CONNECTIONS
    assert bulk_connections(LONG_PATH_RTT) == LONG_PATH_CONNECTIONS
    assert bulk_connections(0.900) == LONG_PATH_CONNECTIONS
    assert LONG_PATH_CONNECTIONS > DEFAULT_CONNECTIONS
    # Where the pool is long, it is dialled at once (no stagger to stretch over 16 slots).
    assert stagger_step(BULK_STAGGER, LONG_PATH_CONNECTIONS, LONG_PATH_RTT + 0.01) == 0.0


@trio_test
async def test_the_client_dials_the_pool_its_path_wants(export_dir: Path) -> None:
    """A greeting that takes LONG_PATH_RTT (a proxy holds the hub's welcomes) makes a client
    left to choose dial LONG_PATH_CONNECTIONS bulk connections; one given a count keeps it."""
    async def slow_welcome(msg: Message) -> Message:
        if isinstance(msg, Welcome):
            await trio.sleep(LONG_PATH_RTT + 0.05)
        return msg

    demand = DEFAULT_DEMAND_CONNECTIONS
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        proxy = Proxy(hub.port, slow_welcome)
        await nursery.start(proxy.serve)
        chosen = HubClient(LOCALHOST, proxy.port, connect_timeout=5.0)
        await nursery.start(chosen.run)
        with trio.fail_after(10):
            while len(chosen._conns) < LONG_PATH_CONNECTIONS + demand:
                await trio.sleep(0.01)
        fixed = HubClient(LOCALHOST, proxy.port, connect_timeout=5.0, connections=2)
        await nursery.start(fixed.run)
        with trio.fail_after(10):
            while len(fixed._conns) < 2 + demand:
                await trio.sleep(0.01)
        await trio.sleep(3 * LONG_PATH_RTT)  # time for a slot past the second to dial: none may
        assert len(fixed._conns) == 2 + demand
        assert len(chosen._conns) == LONG_PATH_CONNECTIONS + demand
        nursery.cancel_scope.cancel()
    # On loopback the same client dials the default pool and no more.
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        client = await started_client(nursery, hub.port)
        await trio.sleep(0.3)
        assert len(client._conns) == DEFAULT_CONNECTIONS + demand
        nursery.cancel_scope.cancel()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 60), st.booleans(), st.integers(1, 10**6)), max_size=40),
       st.floats(0, 30))
def test_the_resend_rate_counts_the_recent_window(events: list[tuple[float, bool, int]],
                                                  after: float) -> None:
    """Against the plain sums: every report of the last window counts, none older than the
    window plus a bucket does (reports come in time order; the query is after the last)."""
    events.sort(key=lambda ev: ev[0])
    rate = ResendRate()
    for t, resent, nbytes in events:
        (rate.on_resent if resent else rate.on_delivered)(t, nbytes)
    now = (events[-1][0] if events else 0.0) + after

    def total(resent: bool, since: float) -> int:
        return sum(n for t, r, n in events if r == resent and t > since)

    delivered, resent_bytes = rate.totals(now)
    for got, kind in ((delivered, False), (resent_bytes, True)):
        assert total(kind, now - RESEND_WINDOW_S) <= got <= total(kind, now - RESEND_WINDOW_S
                                                                  - BUCKET_S)
    expected = resent_bytes / delivered if delivered else 0.0
    assert rate.ratio(now) == pytest.approx(expected)


@trio_test
async def test_prefetch_survives_a_hub_restart(export_dir: Path) -> None:
    e = big(export_dir)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        client = await started_client(nursery, hub.port, congestion="cubic")
        assert await client.read(e.file_id, e.version, 0, 8, priority="prefetch",
                                 deadline=trio.current_time() + 5) == blocks_of(export_dir, 0, 8)
        hub.stop()
        with trio.fail_after(5):
            while client.connected:
                await trio.sleep(0.01)
        hub = await start_hub(nursery, export_dir, port=hub.port)
        data = await client.read(e.file_id, e.version, 40, 400, priority="prefetch",
                                 deadline=trio.current_time() + 10)
        assert data == blocks_of(export_dir, 40, 400)
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_version_1_spoke_is_still_served(export_dir: Path) -> None:
    e = big(export_dir)
    async with trio.open_nursery() as nursery:
        hub = await start_hub(nursery, export_dir)
        async with await trio.open_tcp_stream(LOCALHOST, hub.port) as raw:
            old_read = msgpack.packb([ReadRequest.KIND, 1, e.file_id, e.version, 3, 2])
            await raw.send_all(encode(Hello(1, "old-spoke")) + struct.pack(">I", len(old_read))
                               + old_read)
            decoder, msgs = FrameDecoder(), []
            while len(msgs) < 2:
                msgs += decoder.feed(await raw.receive_some(1 << 20))
        assert msgs[0] == Welcome(1, str(export_dir.resolve()))
        assert isinstance(msgs[1], ReadReply) and msgs[1].data == blocks_of(export_dir, 3, 2)
        assert msgs[1].retransmitted is None  # the 4-field reply an old spoke can decode
        for version, reports in ((2, False), (PROTOCOL_VERSION, True)):
            async with await trio.open_tcp_stream(LOCALHOST, hub.port) as raw:
                await raw.send_all(encode(Hello(version, "spoke"))
                                   + encode(ReadRequest(1, e.file_id, e.version, 3, 2)))
                decoder, msgs = FrameDecoder(), []
                while len(msgs) < 2:
                    msgs += decoder.feed(await raw.receive_some(1 << 20))
            assert isinstance(msgs[1], ReadReply)
            assert (msgs[1].retransmitted is not None) is reports, version
        async with await trio.open_tcp_stream(LOCALHOST, hub.port) as raw:
            await raw.send_all(encode(Hello(PROTOCOL_VERSION + 1, "future")))
            reply = FrameDecoder().feed(await raw.receive_some(1 << 16))
        assert isinstance(reply[0], ErrorReply)
        hub.stop()


# -- over an emulated WAN link ----------------------------------------------------------------

WAN_RTT = 0.06
WAN_RATE = 50e6
WAN_SECONDS = 10.0
WAN_WARMUP = 3.0
WAN_MIN_SHARE = 0.5
"""Share of the link BBR must fill after the warm-up: well below what it reaches, because this
is a pass/fail test on a shared machine, not the measurement. At 70 % it failed once in a
whole-suite run (67.8 %) and passed when run alone; the figure that counts is
``bench.transport``'s."""


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/net/tun")
                    or shutil.which("nsenter") is None,
                    reason="needs root, /dev/net/tun and nsenter")
def test_bbr_fills_most_of_an_emulated_wan_link() -> None:
    from bench import transport
    from bench.wan import LinkSpec, WanLink

    export = transport.make_export()
    with WanLink(LinkSpec(rtt=WAN_RTT, rate_bps=WAN_RATE, seed=1)) as wan:
        transport.configure_node(wan)
        hub = wan.command("hub", [sys.executable, "-m", "bench.transport", "hub", "--export",
                                  str(export), "--listen", f"{wan.hub_addr}:7070"])
        load = wan.command("spoke", [sys.executable, "-m", "bench.transport", "load", "--hub",
                                     f"{wan.hub_addr}:7070", "--client", "bbr",
                                     "--duration", str(WAN_SECONDS)])
        result = transport._run_pair(hub, load, WAN_SECONDS)
    after = sum(n for t, n in result["delivered"] if WAN_WARMUP < t <= WAN_SECONDS)
    goodput = after / (WAN_SECONDS - WAN_WARMUP)
    assert goodput >= WAN_MIN_SHARE * WAN_RATE / 8
    assert all(math.isfinite(lat) for _, lat in result["demand"])
