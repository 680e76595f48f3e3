"""The hub block server: a thin trio shell around ``Export`` and the sans-IO protocol.

Each connection gets a reader and a writer. The reader turns each request into a task; a read
task first takes a slot of its connection's outbox (``OUTBOX_FRAMES`` replies), then queues for
one of the hub's few read slots, which ``FairQueue`` hands out demand first and, within a
class, in equal byte shares per spoke (a spoke is all connections that said hello with the
same name, so a spoke with eight connections gets no more than one with one). A spoke that
stops reading fills only its own outbox: its tasks wait there without holding a read slot,
its reader stops taking requests at ``max_outstanding``, and no other spoke notices. A read
whose every page is cached (and that is small) is served on the event loop, where it costs
less than the hand-off to a thread would; any other read and its checksums run in one of
``READ_SLOTS`` long-lived reader threads (``JobThreads``) so the loop stays free. A request
for several ranges (``ReadManyRequest``, protocol 4) is one task, one read slot and one reply:
its cached ranges are read on the loop, the rest together in one thread job. A request that
comes after ``Mirror`` (protocol 7) is one of two copies a spoke sent on two of its
connections; the first to come is served on the connection the Mirror names (``_Link``), the
other dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from neuralcache.blocks import BLOCK_SIZE

from . import hub_metrics, metrics
from .checksum import range_checksums
from .export import Export, ExportError, WouldBlock
from .job_threads import JobThreads
from .protocol import (LOSS_REPORT_VERSION, META_CHUNK_ENTRIES, MAX_READ_BLOCKS,
                       OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION, ErrorCode, ErrorReply, Hello,
                       MetaReply, MetaRequest, Mirror, PacingLimit, ProtocolError,
                       ReadManyRequest, ReadRequest, Welcome, encode)
from .transport import tcp
from .transport.fair_queue import FairQueue
from .transport.framing import (Frame, FrameReader, read_many_reply_frame, read_reply_frame,
                                send_frame)
from .transport.limits import MAX_REQUESTS_PER_CONNECTION

log = logging.getLogger(__name__)

MAX_OUTSTANDING = MAX_REQUESTS_PER_CONNECTION
"""Requests one connection may have in progress; beyond it the hub stops reading that socket."""

READ_SLOTS = 4
"""Disk reads (with their checksums) in progress at once across all spokes: enough to keep two
cores and the disk busy; more would only let a greedy spoke take more of them at a time."""

INLINE_MAX_BLOCKS = 64
"""Largest read (256 KiB) tried on the event loop. Its copy out of the page cache and its
checksums hold the loop some 70 us (a 16 KiB one 15 us); the 4 MiB prefetch chunks would hold
it for over a millisecond, delaying every other connection's small reads, so they go to a
reader thread, where the hand-off is small beside their own cost."""

# Labelled children looked up once: ``labels()`` costs a few microseconds on every request.
_READ_REQUESTS = hub_metrics.HUB_REQUESTS.labels("read")
_INLINE_READS = hub_metrics.HUB_READS.labels("inline")
_THREAD_READS = hub_metrics.HUB_READS.labels("thread")

Range = tuple[int, int, int, int]
"""``(file_id, version, first, count)``: the blocks one read asks for."""
Blocks = tuple[bytes | bytearray, bytes]
"""Blocks read and their checksums."""

OUTBOX_FRAMES = 4
"""Replies per connection read ahead of its socket: keeps the kernel's buffer fed while
bounding the memory a slow spoke can pin (4 x 4 MiB at most)."""

MIRROR_MEMORY = 4 * MAX_REQUESTS_PER_CONNECTION
"""Request ids a connection remembers having served from a ``Mirror`` pair whose other copy
has not come yet. The twin normally comes within a round trip or two, and the spoke never has
more than ``MAX_REQUESTS_PER_CONNECTION`` out on the connection; beyond that are copies whose
connection died on the way, the oldest of which are forgotten."""

_MIRROR_SERVED, _MIRROR_DUPLICATE, _MIRROR_NO_LINK, _MIRROR_FULL = (
    hub_metrics.HUB_MIRRORED.labels(outcome)
    for outcome in ("served", "duplicate", "no_link", "full"))


@dataclass
class _Waiter:
    event: trio.Event = field(default_factory=trio.Event)
    granted: bool = False


class _FairGate:
    """``slots`` read slots, handed to waiting requests in ``FairQueue`` order."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._queue: FairQueue[_Waiter] = FairQueue()

    async def acquire(self, spoke: str, priority: int, cost: int) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._free > 0 and not self._queue:
            self._free -= 1
            return
        waiter = _Waiter()
        self._queue.push(spoke, priority, cost, waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self.release()  # granted as we were cancelled: pass the slot on
            else:
                self._queue.remove(spoke, priority, waiter)
            raise

    def release(self) -> None:
        waiter = self._queue.pop()
        if waiter is None:
            self._free += 1
        else:
            waiter.granted = True
            waiter.event.set()


class _Outbox:
    """Frames waiting for one connection's writer; read replies hold one of its slots."""

    def __init__(self, max_frames: int) -> None:
        self.slots = trio.Semaphore(max_frames)
        self.send, self.receive = trio.open_memory_channel[tuple[Frame, bool]](
            MAX_REQUESTS_PER_CONNECTION * 2)


@dataclass
class _Link:
    """What serving a request on one connection takes, wherever the request came in: its
    outbox, its bound on requests in progress, its loss report and the nursery of its tasks;
    and the ids of ``Mirror`` requests served on it whose twin has not come yet."""

    outbox: _Outbox
    in_progress: trio.Semaphore
    report: _Retransmissions | None
    nursery: trio.Nursery
    served: dict[int, None] = field(default_factory=dict)

    def first_of_pair(self, req_id: int) -> bool:
        """Whether ``req_id`` is the first copy of its pair to come (and is now served):
        False for the second, which is forgotten with it."""
        if req_id in self.served:
            del self.served[req_id]
            _MIRROR_DUPLICATE.inc()
            return False
        self.served[req_id] = None
        if len(self.served) > MIRROR_MEMORY:
            del self.served[next(iter(self.served))]
        _MIRROR_SERVED.inc()
        return True


class HubServer:
    """Serves one export to any number of spokes."""

    def __init__(self, export: Export, *, max_outstanding: int = MAX_OUTSTANDING,
                 read_slots: int = READ_SLOTS, tcp_congestion: str | None = "bbr") -> None:
        self.export = export
        self._max_outstanding = max_outstanding
        self._tcp_congestion = tcp_congestion
        hub_metrics.HUB_BULK_CONGESTION.clear()
        hub_metrics.HUB_BULK_CONGESTION.labels(tcp_congestion or "default").set(1)
        self._gate = _FairGate(read_slots)
        # One thread per read slot: a slot's read never waits for a thread. Long-lived, as a
        # small read from the disk is mostly the hand-off (``python -m bench.hub_cpu``).
        self._readers = JobThreads(threads=read_slots, follow_loop_cpu=False,
                                   name="neuralcache-hub-reader")
        self._scan_lock = trio.Lock()
        self._spokes: dict[str, int] = {}  # spoke name -> open connections
        self._links: dict[tuple[str, int], _Link] = {}  # (spoke, Hello.link) -> its connection

    async def serve(self, host: str, port: int, *,
                    task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve forever; ``task_status.started`` gets the bound listeners."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        try:
            task_status.started(listeners)
            await trio.serve_listeners(self.handle_connection, listeners)
        finally:
            self._readers.close()

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        spoke: str | None = None
        retransmissions = _Retransmissions(stream)
        try:
            reader = FrameReader(stream)
            hello = await self._greet(stream, reader)
            if hello is None:
                return
            # By the role the hello gives (nothing if the stream is not a socket).
            tcp.configure(stream, tcp.congestion_for(hello.role, self._tcp_congestion))
            spoke = hello.client
            self._joined(spoke)
            outbox = _Outbox(OUTBOX_FRAMES)
            report = retransmissions if reader.version >= LOSS_REPORT_VERSION else None
            async with trio.open_nursery() as nursery:
                link = _Link(outbox, trio.Semaphore(self._max_outstanding), report, nursery)
                name = None if hello.link is None else (spoke, hello.link)
                if name is not None:
                    self._links[name] = link  # a spoke that reuses a number means the new one
                try:
                    nursery.start_soon(self._writer, stream, outbox, retransmissions)
                    await self._reader(stream, reader, spoke, link)
                    nursery.cancel_scope.cancel()
                finally:
                    if name is not None and self._links.get(name) is link:
                        del self._links[name]
        except* ProtocolError as group:
            metrics.PROTOCOL_ERRORS.labels("hub").inc()
            log.error("hub: closing connection after a protocol error: %s", group.exceptions[0])
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            log.info("hub: connection lost")
        finally:
            if spoke is not None:
                self._left(spoke)
            retransmissions.update()
            await trio.aclose_forcefully(stream)

    def _joined(self, spoke: str) -> None:
        self._spokes[spoke] = self._spokes.get(spoke, 0) + 1
        if self._spokes[spoke] == 1:
            hub_metrics.HUB_CONNECTED_SPOKES.inc()
            log.info("hub: spoke %s connected", spoke)

    def _left(self, spoke: str) -> None:
        self._spokes[spoke] -= 1
        if not self._spokes[spoke]:
            del self._spokes[spoke]
            hub_metrics.HUB_CONNECTED_SPOKES.dec()

    async def _greet(self, stream: trio.abc.Stream, reader: FrameReader) -> Hello | None:
        """Answer the hello and return it; None if the spoke hung up before saying anything."""
        msg = await reader.receive()
        if msg is None:
            return None
        if not isinstance(msg, Hello):
            raise ProtocolError(f"expected hello, got {type(msg).__name__}")
        if not OLDEST_PROTOCOL_VERSION <= msg.version <= PROTOCOL_VERSION:
            await stream.send_all(encode(ErrorReply(
                0, ErrorCode.VERSION_MISMATCH, f"hub speaks protocol {OLDEST_PROTOCOL_VERSION}.."
                f"{PROTOCOL_VERSION}, spoke {msg.version}")))
            raise ProtocolError(f"spoke {msg.client!r} speaks protocol {msg.version}")
        reader.version = msg.version
        await stream.send_all(encode(Welcome(msg.version, self.export.root)))
        return msg

    async def _reader(self, stream: trio.abc.Stream, reader: FrameReader, spoke: str,
                      link: _Link) -> None:
        """Serve the connection's requests, each on the connection it belongs on (``Mirror``
        names another of the spoke's); ``link.report`` (protocol >= 3) tells each read reply
        how much its connection has retransmitted."""
        mirror: int | None = None  # the link the next request's reply belongs on, if named
        while True:
            msg = await reader.receive()
            if msg is None:
                return
            if isinstance(msg, PacingLimit):
                tcp.limit_pacing(stream, msg.rate)
                continue
            if isinstance(msg, Mirror):
                if mirror is not None:
                    raise ProtocolError("Mirror must be followed by a read request")
                mirror = msg.link
                continue
            if not isinstance(msg, (ReadRequest, ReadManyRequest, MetaRequest)):
                raise ProtocolError(f"a spoke may not send {type(msg).__name__}")
            if mirror is not None:
                if isinstance(msg, MetaRequest):
                    raise ProtocolError("Mirror must be followed by a read request")
                target, mirror = self._links.get((spoke, mirror)), None
                if target is not link:
                    self._serve_twin(target, msg, spoke)
                    continue
                if msg.req_id in link.served:  # its twin, on another connection, was first
                    link.first_of_pair(msg.req_id)
                    continue
                await link.in_progress.acquire()
                if not link.first_of_pair(msg.req_id):  # the twin came while this waited
                    link.in_progress.release()
                    continue
            else:
                await link.in_progress.acquire()
            link.nursery.start_soon(self._serve_request, msg, spoke, link)

    def _serve_twin(self, target: _Link | None, msg: ReadRequest | ReadManyRequest,
                    spoke: str) -> None:
        """A copy of a request whose reply belongs on another connection (``target``): served
        there if it is the first of its pair to come. Never waits: a reader that waited for
        another connection's room would hold up its own requests. Dropped if there is no room,
        as the copy on ``target`` itself then waits for it."""
        if target is None:
            _MIRROR_NO_LINK.inc()  # that connection is gone: the spoke sends its requests again
            return
        if msg.req_id not in target.served:
            try:
                target.in_progress.acquire_nowait()
            except trio.WouldBlock:
                _MIRROR_FULL.inc()
                return
        if target.first_of_pair(msg.req_id):
            target.nursery.start_soon(self._serve_request, msg, spoke, target)

    async def _serve_request(self, msg: ReadRequest | ReadManyRequest | MetaRequest, spoke: str,
                             link: _Link) -> None:
        outbox, report = link.outbox, link.report
        try:
            if isinstance(msg, (ReadRequest, ReadManyRequest)):
                _READ_REQUESTS.inc()
                await outbox.slots.acquire()
                try:
                    frame = await (self._read(msg, spoke, report) if isinstance(msg, ReadRequest)
                                   else self._read_many(msg, spoke, report))
                except BaseException:
                    outbox.slots.release()
                    raise
                await outbox.send.send((frame, True))
            else:
                hub_metrics.HUB_REQUESTS.labels("meta").inc()
                for frame in await self._metadata(msg):
                    await outbox.send.send(((frame,), False))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the connection is going away; the writer reports it
        finally:
            link.in_progress.release()

    async def _read(self, req: ReadRequest, spoke: str, report: _Retransmissions | None
                    ) -> Frame:
        if not 0 < req.count <= MAX_READ_BLOCKS:
            return _error(req.req_id, ErrorCode.BAD_REQUEST,
                          f"block count must be 1..{MAX_READ_BLOCKS}, got {req.count}")
        await self._gate.acquire(spoke, req.priority, req.count * BLOCK_SIZE)
        try:
            data, sums = await self._read_anywhere(req)
        except ExportError as exc:
            return _error(req.req_id, exc.code, str(exc))
        except Exception as exc:  # a bug or an OS surprise: fail this request, not the hub
            log.exception("hub: reading file %d blocks %d+%d failed", req.file_id, req.first,
                          req.count)
            return _error(req.req_id, ErrorCode.IO_ERROR, f"hub failed to read: {exc!r}")
        finally:
            self._gate.release()
        hub_metrics.HUB_SENT_BYTES.inc(len(data))
        return read_reply_frame(req.req_id, req.first, data, sums,
                                None if report is None else report.total)

    async def _read_anywhere(self, req: ReadRequest) -> Blocks:
        """The read and its checksums on the loop if nothing in them waits for the disk, else
        all over again in a worker thread. Either holds a read slot, so the fair order of the
        slots is kept; an inline read gives it back before any other task runs."""
        rng = (req.file_id, req.version, req.first, req.count)
        if self.export.nowait_reads and req.count <= INLINE_MAX_BLOCKS:
            try:
                result = self._read_and_sum(*rng, nowait=True)
            except WouldBlock:
                pass
            else:
                _INLINE_READS.inc()
                return result
        result = await self._readers.run(self._read_and_sum, *rng)
        _THREAD_READS.inc()
        return result

    def _read_and_sum(self, file_id: int, version: int, first: int, count: int,
                      nowait: bool = False) -> Blocks:
        data = self.export.read_blocks(file_id, version, first, count, nowait=nowait)
        return data, range_checksums(data)

    async def _read_many(self, req: ReadManyRequest, spoke: str,
                         report: _Retransmissions | None) -> Frame:
        """One reply to every range of ``req``, read under one read slot whose fair share is
        charged for all of them; a range that fails is reported alone, the others served."""
        if not 0 < req.blocks <= MAX_READ_BLOCKS or any(r[3] == 0 for r in req.ranges):
            return _error(req.req_id, ErrorCode.BAD_REQUEST,
                          f"ranges must be non-empty and add up to 1..{MAX_READ_BLOCKS} blocks,"
                          f" got {[r[3] for r in req.ranges]}")
        await self._gate.acquire(spoke, req.priority, req.blocks * BLOCK_SIZE)
        try:
            outcomes = await self._read_ranges(req.ranges, inline=req.blocks <= INLINE_MAX_BLOCKS)
        finally:
            self._gate.release()
        parts: list[Blocks] = []
        errors: list[tuple[int, str, str]] = []
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, ExportError):
                hub_metrics.HUB_ERRORS.labels(outcome.code).inc()
                errors.append((index, outcome.code, str(outcome)))
                outcome = (b"", b"")
            parts.append(outcome)
        hub_metrics.HUB_SENT_BYTES.inc(sum(len(data) for data, _ in parts))
        return read_many_reply_frame(req.req_id, parts, errors,
                                     0 if report is None else report.total)

    async def _read_ranges(self, ranges: tuple[Range, ...], *, inline: bool
                           ) -> list[Blocks | ExportError]:
        """Each range's blocks or error. With ``inline``, every range is tried on the loop and
        those that would wait for the disk are read in one thread job: one hand-off for the
        request, as a ReadRequest has, not one per range."""
        done: dict[int, Blocks | ExportError] = {}
        if inline and self.export.nowait_reads:
            for index, rng in enumerate(ranges):
                try:
                    done[index] = self._range_or_error(rng, nowait=True)
                except WouldBlock:
                    pass
        waiting = [index for index in range(len(ranges)) if index not in done]
        if waiting:
            done.update(zip(waiting, await self._readers.run(
                self._ranges_or_errors, [ranges[index] for index in waiting])))
            _THREAD_READS.inc()
        else:
            _INLINE_READS.inc()
        return [done[index] for index in range(len(ranges))]

    def _ranges_or_errors(self, ranges: list[Range]) -> list[Blocks | ExportError]:
        return [self._range_or_error(rng) for rng in ranges]

    def _range_or_error(self, rng: Range, nowait: bool = False) -> Blocks | ExportError:
        """One range of a multi-range read, or why it failed: its failure must not fail the
        ranges that share its request. Only WouldBlock escapes (to be read in a thread)."""
        try:
            return self._read_and_sum(*rng, nowait=nowait)
        except WouldBlock:
            raise
        except ExportError as exc:
            return exc
        except Exception as exc:  # a bug or an OS surprise: fail this range, not the hub
            log.exception("hub: reading file %d blocks %d+%d failed", rng[0], rng[2], rng[3])
            return ExportError(ErrorCode.IO_ERROR, f"hub failed to read: {exc!r}")

    async def _metadata(self, req: MetaRequest) -> list[bytes]:
        async with self._scan_lock:
            entries = await trio.to_thread.run_sync(self.export.scan)
        chunks = [entries[i:i + META_CHUNK_ENTRIES]
                  for i in range(0, len(entries), META_CHUNK_ENTRIES)]
        return [encode(MetaReply(req.req_id, tuple(chunk), i == len(chunks) - 1))
                for i, chunk in enumerate(chunks)]

    async def _writer(self, stream: trio.abc.Stream, outbox: _Outbox,
                      retransmissions: _Retransmissions) -> None:
        async for frame, holds_slot in outbox.receive:
            await send_frame(stream, frame)
            retransmissions.update()
            if holds_slot:
                outbox.slots.release()


class _Retransmissions:
    """Feeds ``neuralcache_hub_retransmitted_bytes_total`` from one connection's kernel count,
    looked at after each frame sent and once more as the connection closes."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._counted = 0

    @property
    def total(self) -> int:
        """Bytes retransmitted on the connection as of the last frame sent."""
        return self._counted

    def update(self) -> None:
        total = tcp.retransmitted_bytes(self._stream)
        if total is not None and total > self._counted:
            hub_metrics.HUB_RETRANSMITTED_BYTES.inc(total - self._counted)
            self._counted = total


def _error(req_id: int, code: str, message: str) -> Frame:
    hub_metrics.HUB_ERRORS.labels(code).inc()
    return (encode(ErrorReply(req_id, code, message)),)
