"""The spoke's connection to the hub: request/response over one stream, with reconnects.

``HubClient.run`` owns the connection and redials with exponential backoff when it breaks;
requests wait for a live link until their deadline, are re-sent on a new connection if the old
one died under them, and blocks are checked against the hub's checksums before they are
returned. Callers see ``HubUnavailable``, ``ChecksumError`` or ``RemoteError`` - nothing else.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import trio

from neuralcache.blocks import BLOCK_SIZE

from . import metrics
from .checksum import bad_blocks
from .protocol import (PROTOCOL_VERSION, ErrorReply, FrameDecoder, Hello, Message, MetaEntry,
                       MetaReply, MetaRequest, ProtocolError, ReadReply, ReadRequest, Welcome,
                       encode)

log = logging.getLogger(__name__)

RECEIVE_CHUNK = 1024 * 1024
"""Bytes asked of the socket per receive: large, since replies carry up to 4 MiB of blocks."""

BACKOFF_INITIAL = 0.1
"""First redial delay after the hub is lost (seconds); doubles up to ``BACKOFF_MAX``."""
BACKOFF_MAX = 5.0

CHECKSUM_ATTEMPTS = 3
"""Fetches of a range whose blocks keep failing verification before the read fails."""


class HubUnavailable(Exception):
    """The hub could not be reached (or answered nothing) before the deadline."""


class ChecksumError(Exception):
    """The hub kept sending blocks that fail their checksums."""


class RemoteError(Exception):
    """The hub refused the request; ``code`` is a protocol ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class _ConnectionLost(Exception):
    """Internal: the connection a request was sent on is gone; the request may be retried."""


@dataclass
class _Pending:
    done: trio.Event = field(default_factory=trio.Event)
    reply: Message | None = None
    chunks: list[MetaEntry] = field(default_factory=list)
    lost: bool = False


class _Connection:
    """One live, greeted stream to the hub and the requests waiting on it."""

    def __init__(self, stream: trio.abc.Stream, decoder: FrameDecoder) -> None:
        self.stream = stream
        self.decoder = decoder
        self.pending: dict[int, _Pending] = {}
        self.send_lock = trio.Lock()
        self.closed = False

    async def send(self, frame: bytes) -> None:
        async with self.send_lock:
            await self.stream.send_all(frame)

    async def receive_loop(self) -> None:
        while True:
            data = await self.stream.receive_some(RECEIVE_CHUNK)
            if not data:
                raise trio.BrokenResourceError("hub closed the connection")
            for msg in self.decoder.feed(data):
                self._dispatch(msg)

    def _dispatch(self, msg: Message) -> None:
        if not isinstance(msg, (ReadReply, MetaReply, ErrorReply)):
            raise ProtocolError(f"unexpected {type(msg).__name__} from the hub")
        slot = self.pending.get(msg.req_id)
        if slot is None:
            return  # a reply to a request that already timed out
        if isinstance(msg, MetaReply):
            slot.chunks.extend(msg.entries)
            if not msg.done:
                return
        slot.reply = msg
        del self.pending[msg.req_id]
        slot.done.set()

    def fail_all(self) -> None:
        self.closed = True
        for slot in self.pending.values():
            slot.lost = True
            slot.done.set()
        self.pending.clear()


class HubClient:
    """A spoke's link to one hub."""

    def __init__(self, host: str, port: int, *, name: str = "spoke",
                 connect_timeout: float = 10.0, attempt_timeout: float = 30.0) -> None:
        self.host = host
        self.port = port
        self.name = name
        self.connect_timeout = connect_timeout
        self.attempt_timeout = attempt_timeout
        self._conn: _Connection | None = None
        self._link_changed = trio.Event()
        self._ids = itertools.count(1)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Connect (raising HubUnavailable if that fails within connect_timeout), then keep the
        link up forever, redialling with backoff."""
        with trio.move_on_after(self.connect_timeout):
            conn = await self._dial_until_up()
        if self._conn is None:
            raise HubUnavailable(
                f"cannot reach the hub at {self.host}:{self.port} within {self.connect_timeout:g} s")
        task_status.started()
        while True:
            await self._serve(conn)
            conn = await self._dial_until_up()

    async def _dial_until_up(self) -> _Connection:
        backoff = BACKOFF_INITIAL
        while True:
            try:
                conn = await self._dial()
            except (OSError, trio.BrokenResourceError, ProtocolError) as exc:
                log.warning("hub %s:%s unreachable (%s); retrying in %.1f s",
                            self.host, self.port, exc, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            self._set_link(conn)
            return conn

    async def _dial(self) -> _Connection:
        stream = await trio.open_tcp_stream(self.host, self.port)
        try:
            decoder = FrameDecoder()
            await stream.send_all(encode(Hello(PROTOCOL_VERSION, self.name)))
            with trio.fail_after(self.connect_timeout):
                msgs: list[Message] = []
                while not msgs:
                    data = await stream.receive_some(RECEIVE_CHUNK)
                    if not data:
                        raise trio.BrokenResourceError("hub closed the connection during hello")
                    msgs = decoder.feed(data)
            if isinstance(msgs[0], ErrorReply):
                raise ProtocolError(f"hub refused the hello: {msgs[0].message}")
            if not isinstance(msgs[0], Welcome):
                raise ProtocolError(f"expected welcome, got {type(msgs[0]).__name__}")
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        conn = _Connection(stream, decoder)
        for msg in msgs[1:]:
            conn._dispatch(msg)
        return conn

    def _set_link(self, conn: _Connection | None) -> None:
        self._conn = conn
        metrics.HUB_LINK_UP.set(1 if conn is not None else 0)
        self._link_changed.set()
        self._link_changed = trio.Event()

    async def _serve(self, conn: _Connection) -> None:
        try:
            await conn.receive_loop()
        except ProtocolError as exc:
            metrics.PROTOCOL_ERRORS.labels("spoke").inc()
            log.error("hub sent a malformed frame (%s); reconnecting", exc)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.warning("lost the hub connection: %s", exc)
        finally:
            self._set_link(None)
            conn.fail_all()
            await trio.aclose_forcefully(conn.stream)

    async def _link(self, deadline: float) -> _Connection:
        while self._conn is None:
            if trio.current_time() >= deadline:
                raise HubUnavailable(f"hub {self.host}:{self.port} unreachable")
            with trio.move_on_at(deadline):
                await self._link_changed.wait()
        return self._conn

    async def _request(self, make: Any, deadline: float) -> Message:
        """Send ``make(req_id)`` and wait for its reply, re-sending after a lost connection."""
        while True:
            conn = await self._link(deadline)
            req_id = next(self._ids)
            slot = _Pending()
            conn.pending[req_id] = slot
            try:
                await conn.send(encode(make(req_id)))
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                slot.lost = True
            if not slot.lost:
                with trio.move_on_at(min(deadline, trio.current_time() + self.attempt_timeout)):
                    await slot.done.wait()
            conn.pending.pop(req_id, None)
            if slot.reply is not None:
                if isinstance(slot.reply, ErrorReply):
                    raise RemoteError(slot.reply.code, slot.reply.message)
                if isinstance(slot.reply, MetaReply):
                    return MetaReply(slot.reply.req_id, tuple(slot.chunks), True)
                return slot.reply
            if not slot.lost and not conn.closed:
                # No answer in attempt_timeout on a connection that looks alive: drop it.
                log.warning("hub did not answer request %d in time; redialling", req_id)
                await trio.aclose_forcefully(conn.stream)
            if trio.current_time() >= deadline:
                raise HubUnavailable(f"no answer from hub {self.host}:{self.port} in time")
            metrics.HUB_FETCH_RETRIES.inc()

    async def metadata(self, timeout: float = math.inf) -> list[MetaEntry]:
        """The export's namespace snapshot."""
        reply = await self._request(MetaRequest, trio.current_time() + timeout)
        assert isinstance(reply, MetaReply)
        return list(reply.entries)

    async def read(self, file_id: int, version: int, first: int, count: int, *,
                   deadline: float) -> bytes:
        """Blocks ``first`` .. ``first + count - 1``, verified against their checksums."""
        for _ in range(CHECKSUM_ATTEMPTS):
            reply = await self._request(
                lambda rid: ReadRequest(rid, file_id, version, first, count), deadline)
            assert isinstance(reply, ReadReply)
            if reply.first != first or len(reply.data) > count * BLOCK_SIZE:
                bad = list(range(count))  # not the range asked for: as good as corrupt
            else:
                bad = bad_blocks(reply.data, reply.checksums)
            if not bad:
                return reply.data
            metrics.CHECKSUM_FAILURES.inc(len(bad))
            log.error("%d block(s) of file %d from block %d failed their checksum; re-fetching",
                      len(bad), file_id, first)
            metrics.HUB_FETCH_RETRIES.inc()
        raise ChecksumError(f"file {file_id} blocks {first}+{count}: checksum mismatch "
                            f"{CHECKSUM_ATTEMPTS} times")
