"""The hub block server: a thin trio shell around ``Export`` and the sans-IO protocol.

Each connection gets a reader, a writer and a bounded set of request tasks. A slow or stuck
spoke fills only its own reply channel; its reader then stops taking requests, and no other
connection notices. Disk reads and checksums run in worker threads so the loop stays free.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from . import hub_metrics, metrics
from .checksum import range_checksums
from .export import Export, ExportError
from .protocol import (META_CHUNK_ENTRIES, MAX_READ_BLOCKS, PROTOCOL_VERSION, ErrorCode,
                       ErrorReply, FrameDecoder, Hello, Message, MetaReply, MetaRequest,
                       ProtocolError, ReadReply, ReadRequest, Welcome, encode)

log = logging.getLogger(__name__)

MAX_OUTSTANDING = 64
"""Requests one connection may have in progress; beyond it the hub stops reading that socket."""

RECEIVE_CHUNK = 256 * 1024
"""Bytes asked of the socket per receive; requests are small, so this is plenty."""


class HubServer:
    """Serves one export to any number of spokes."""

    def __init__(self, export: Export, *, max_outstanding: int = MAX_OUTSTANDING) -> None:
        self.export = export
        self._max_outstanding = max_outstanding
        self._scan_lock = trio.Lock()

    async def serve(self, host: str, port: int, *,
                    task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve forever; ``task_status.started`` gets the bound listeners."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started(listeners)
        await trio.serve_listeners(self.handle_connection, listeners)

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        hub_metrics.HUB_CONNECTED_SPOKES.inc()
        send, receive = trio.open_memory_channel[bytes](self._max_outstanding)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, stream, receive)
                await self._reader(stream, nursery, send)
                nursery.cancel_scope.cancel()
        except* ProtocolError as group:
            metrics.PROTOCOL_ERRORS.labels("hub").inc()
            log.error("hub: closing connection after a protocol error: %s", group.exceptions[0])
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            log.info("hub: connection lost")
        finally:
            hub_metrics.HUB_CONNECTED_SPOKES.dec()
            await trio.aclose_forcefully(stream)

    async def _reader(self, stream: trio.abc.Stream, nursery: trio.Nursery,
                      send: trio.MemorySendChannel[bytes]) -> None:
        decoder = FrameDecoder()
        slots = trio.Semaphore(self._max_outstanding)
        greeted = False
        while True:
            data = await stream.receive_some(RECEIVE_CHUNK)
            if not data:
                if decoder.buffered:
                    raise ProtocolError(f"connection closed inside a frame ({decoder.buffered} bytes)")
                return
            for msg in decoder.feed(data):
                if not greeted:
                    await self._greet(stream, msg)
                    greeted = True
                    continue
                if not isinstance(msg, (ReadRequest, MetaRequest)):
                    raise ProtocolError(f"a spoke may not send {type(msg).__name__}")
                await slots.acquire()
                nursery.start_soon(self._serve_request, msg, send, slots)

    async def _greet(self, stream: trio.abc.Stream, msg: Message) -> None:
        if not isinstance(msg, Hello):
            raise ProtocolError(f"expected hello, got {type(msg).__name__}")
        if msg.version != PROTOCOL_VERSION:
            await stream.send_all(encode(ErrorReply(
                0, ErrorCode.VERSION_MISMATCH,
                f"hub speaks protocol {PROTOCOL_VERSION}, spoke {msg.version}")))
            raise ProtocolError(f"spoke {msg.client!r} speaks protocol {msg.version}")
        log.info("hub: spoke %s connected", msg.client)
        await stream.send_all(encode(Welcome(PROTOCOL_VERSION, self.export.root)))

    async def _serve_request(self, msg: ReadRequest | MetaRequest, send: trio.MemorySendChannel[bytes],
                             slots: trio.Semaphore) -> None:
        try:
            if isinstance(msg, ReadRequest):
                hub_metrics.HUB_REQUESTS.labels("read").inc()
                await send.send(await self._read(msg))
            else:
                hub_metrics.HUB_REQUESTS.labels("meta").inc()
                for frame in await self._metadata(msg):
                    await send.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the connection is going away; the writer reports it
        finally:
            slots.release()

    async def _read(self, req: ReadRequest) -> bytes:
        if not 0 < req.count <= MAX_READ_BLOCKS:
            return _error(req.req_id, ErrorCode.BAD_REQUEST,
                          f"block count must be 1..{MAX_READ_BLOCKS}, got {req.count}")
        try:
            data, sums = await trio.to_thread.run_sync(self._read_and_sum, req)
        except ExportError as exc:
            return _error(req.req_id, exc.code, str(exc))
        hub_metrics.HUB_SENT_BYTES.inc(len(data))
        return encode(ReadReply(req.req_id, req.first, data, sums))

    def _read_and_sum(self, req: ReadRequest) -> tuple[bytes, bytes]:
        data = self.export.read_blocks(req.file_id, req.version, req.first, req.count)
        return data, range_checksums(data)

    async def _metadata(self, req: MetaRequest) -> list[bytes]:
        async with self._scan_lock:
            entries = await trio.to_thread.run_sync(self.export.scan)
        chunks = [entries[i:i + META_CHUNK_ENTRIES]
                  for i in range(0, len(entries), META_CHUNK_ENTRIES)]
        return [encode(MetaReply(req.req_id, tuple(chunk), i == len(chunks) - 1))
                for i, chunk in enumerate(chunks)]

    async def _writer(self, stream: trio.abc.Stream,
                      receive: trio.MemoryReceiveChannel[bytes]) -> None:
        async for frame in receive:
            await stream.send_all(frame)


def _error(req_id: int, code: str, message: str) -> bytes:
    hub_metrics.HUB_ERRORS.labels(code).inc()
    return encode(ErrorReply(req_id, code, message))
