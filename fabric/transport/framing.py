"""Reading whole frames off a trio stream with as few copies as Python allows.

``protocol.FrameDecoder`` appends every received chunk to one buffer and slices each payload
out of it, copying a 4 MiB reply three times. Here a large payload is received straight into a
buffer of its own (``recv_into``), which its message keeps: a block reply's data is a view of
it (``decode_owned_payload``), and so is each range of it (``ReadManyReply.parts``). Small
frames come out of a reused staging buffer, and msgpack copies their fields out. A prefetch
whose blocks came in several replies is handed over in those parts
(``HubClient.start_prefetch``); only ``HubClient.read`` joins them. At 1 GB/s that is the
difference between a spoke that keeps up and one that does not.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

import msgpack
import numpy
import trio

from neuralcache.blocks import BLOCK_SIZE

from ..protocol import (CHECKSUM_BYTES, MAX_FRAME, PROTOCOL_VERSION, Message, ProtocolError,
                        ReadManyReply, ReadReply, decode_owned_payload, decode_payload)

STAGING_BYTES = 256 * 1024
"""Receive buffer for headers and small frames; larger payloads get a buffer of their own."""
RCVLOWAT_MAX = 1024 * 1024
"""Most bytes a large frame's reader waits to have queued before it is woken (SO_RCVLOWAT):
each wake-up costs the event loop a round, and a 4 MiB frame otherwise took ~25 of them on
loopback (docs/transport.md, "Fewer wake-ups per large frame")."""

_HEADER = struct.Struct(">I")
_FIXARRAY_5 = b"\x95"  # msgpack: an array of five items ([kind, req_id, first, data, sums])
_FIXARRAY_6 = b"\x96"  # the same and the retransmitted count (protocol version >= 3)
_FIXARRAY_7 = b"\x97"  # [kind, req_id, sizes, data, sums, errors, retransmitted] (ReadManyReply)
LOSS_FIELD_MAX_BYTES = 9
"""Most bytes the retransmitted count takes in a reply (msgpack uint 64)."""

Buffer = bytes | bytearray | memoryview
Frame = Sequence[Buffer]
"""A frame as buffers to be sent back to back (scatter-gather, nothing joined in Python)."""


def read_reply_frame(req_id: int, first: int, data: bytes, checksums: bytes,
                     retransmitted: int | None = None) -> Frame:
    """``encode(ReadReply(...))`` as three buffers, the block data not copied: the same bytes
    (msgpack encodes an array as its header followed by its items), without packing 4 MiB
    into msgpack's buffer, copying it out and copying it again behind the frame header."""
    head = b"".join([_FIXARRAY_5 if retransmitted is None else _FIXARRAY_6,
                     msgpack.packb(ReadReply.KIND), msgpack.packb(req_id),
                     msgpack.packb(first), _bin_header(len(data))])
    tail = msgpack.packb(checksums, use_bin_type=True)
    if retransmitted is not None:
        tail += msgpack.packb(retransmitted)
    length = len(head) + len(data) + len(tail)
    if length > MAX_FRAME:
        raise ValueError(f"message of {length} bytes exceeds MAX_FRAME")
    return (_HEADER.pack(length) + head, data, tail)


def read_reply_size(req_id: int, first: int, count: int, *, loss_report: bool = False) -> int:
    """Bytes on the wire of the reply to a read of ``count`` whole blocks (frame header too);
    with ``loss_report`` (version >= 3), the most the retransmitted count can add."""
    data = count * BLOCK_SIZE
    sums = count * CHECKSUM_BYTES
    return (loss_report * LOSS_FIELD_MAX_BYTES
            + _HEADER.size + len(_FIXARRAY_5) + len(msgpack.packb(ReadReply.KIND))
            + len(msgpack.packb(req_id)) + len(msgpack.packb(first)) + len(_bin_header(data))
            + data + len(_bin_header(sums)) + sums)


def read_many_reply_frame(req_id: int, parts: Sequence[tuple[Buffer, bytes]],
                          errors: Sequence[tuple[int, str, str]], retransmitted: int) -> Frame:
    """``encode(ReadManyReply(...))`` as buffers, each range's ``(data, checksums)`` in
    ``parts`` (empty for a failed range, listed in ``errors``), the data not copied: msgpack's
    one ``bin`` of all the ranges' bytes is its header followed by them back to back."""
    sizes = [len(data) for data, _ in parts]
    head = b"".join([_FIXARRAY_7, msgpack.packb(ReadManyReply.KIND), msgpack.packb(req_id),
                     msgpack.packb(sizes), _bin_header(sum(sizes))])
    tail = b"".join([msgpack.packb(b"".join(sums for _, sums in parts), use_bin_type=True),
                     msgpack.packb([list(e) for e in errors]), msgpack.packb(retransmitted)])
    length = len(head) + sum(sizes) + len(tail)
    if length > MAX_FRAME:
        raise ValueError(f"message of {length} bytes exceeds MAX_FRAME")
    return (_HEADER.pack(length) + head, *(data for data in (p[0] for p in parts) if len(data)),
            tail)


def read_many_reply_size(req_id: int, counts: Sequence[int]) -> int:
    """Bytes on the wire of the reply to ranges of ``counts`` whole blocks, none failing (frame
    header too), the retransmitted count taking the most it can."""
    data = sum(counts) * BLOCK_SIZE
    sums = sum(counts) * CHECKSUM_BYTES
    return (_HEADER.size + len(_FIXARRAY_7) + len(msgpack.packb(ReadManyReply.KIND))
            + len(msgpack.packb(req_id)) + len(msgpack.packb([c * BLOCK_SIZE for c in counts]))
            + len(_bin_header(data)) + data + len(_bin_header(sums)) + sums
            + len(msgpack.packb([])) + LOSS_FIELD_MAX_BYTES)


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


async def send_frame(stream: trio.abc.SendStream, frame: Frame) -> None:
    """Send all of ``frame``'s buffers, with sendmsg where the stream is a socket."""
    sock = getattr(stream, "socket", None)
    if sock is None or len(frame) == 1:
        await stream.send_all(frame[0] if len(frame) == 1 else b"".join(frame))
        return
    views = [memoryview(b) for b in frame if len(b)]
    while views:
        sent = await sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


class FrameReader:
    """Yields one decoded message per ``receive``; None at a clean end of stream."""

    def __init__(self, stream: trio.abc.ReceiveStream, *, max_frame: int = MAX_FRAME,
                 version: int = PROTOCOL_VERSION) -> None:
        self._stream = stream
        self._socket = getattr(stream, "socket", None)  # a trio SocketStream's socket
        self._max_frame = max_frame
        self.version = version
        """Protocol the peer speaks; the hub lowers it after a version-1 hello."""
        self._staging = bytearray(STAGING_BYTES)
        self._view = memoryview(self._staging)
        self._start = 0  # unread bytes are _staging[_start:_end]
        self._end = 0
        self._lowat = 1  # the socket's SO_RCVLOWAT
        self.consumed = 0
        """Stream bytes of every frame returned so far (headers included)."""

    async def receive(self) -> Message | None:
        """The next message; None if the peer closed between frames. Raises ProtocolError on a
        malformed, oversized or truncated frame."""
        if not await self._fill(_HEADER.size, at_boundary=True):
            return None
        (length,) = _HEADER.unpack_from(self._staging, self._start)
        self._start += _HEADER.size
        if length > self._max_frame:
            raise ProtocolError(f"frame of {length} bytes exceeds limit {self._max_frame}")
        self.consumed += _HEADER.size + length
        if length <= STAGING_BYTES // 2:
            await self._fill(length, at_boundary=False)
            payload = self._view[self._start:self._start + length]
            self._start += length
            try:
                return decode_payload(payload, self.version)  # type: ignore[arg-type]
            finally:
                payload.release()
        # Not zeroed (every byte is about to be received), and not reused: the message keeps it.
        payload = memoryview(numpy.empty(length, numpy.uint8))
        await self._receive_large(payload)
        return decode_owned_payload(payload, self.version)

    async def _receive_large(self, payload: memoryview) -> None:
        length = len(payload)
        have = min(self._end - self._start, length)
        payload[:have] = self._view[self._start:self._start + have]
        self._start += have
        most = self._lowat_limit()
        try:
            while have < length:
                self._wake_at(min(length - have, most))
                got = await self._recv_into(payload[have:])
                if got == 0:
                    raise ProtocolError(
                        f"connection closed inside a frame ({have} of {length} bytes)")
                have += got
        finally:
            self._wake_at(1)

    def _lowat_limit(self) -> int:
        """The most to wait for: RCVLOWAT_MAX, and no more than a quarter of the receive buffer
        as it is now. A wait for more makes the kernel grow the buffer to hold it and clamp the
        TCP window to the wait (``tcp_set_rcvlowat``), a cap of 1 MiB per connection's window
        until autotuning lifts it again."""
        if self._socket is None:
            return RCVLOWAT_MAX
        try:
            return min(RCVLOWAT_MAX, self._socket.getsockopt(socket.SOL_SOCKET,
                                                             socket.SO_RCVBUF) // 4)
        except OSError:
            return 1  # the connection is gone: the next receive says so

    def _wake_at(self, nbytes: int) -> None:
        """Have the socket wake this reader only once ``nbytes`` are queued (SO_RCVLOWAT),
        never more than the frame still owes: beyond it the bytes may never come."""
        if nbytes != self._lowat and self._socket is not None:
            try:
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            except OSError:
                return  # the connection is gone: the next receive says so
            self._lowat = nbytes

    async def _fill(self, need: int, *, at_boundary: bool) -> bool:
        """Make ``need`` unread bytes available in the staging buffer; False on EOF before any
        byte of them arrived at a frame boundary."""
        while self._end - self._start < need:
            if self._start and self._start + need > STAGING_BYTES:
                unread = self._end - self._start
                self._staging[:unread] = self._staging[self._start:self._end]
                self._start, self._end = 0, unread
            got = await self._recv_into(self._view[self._end:])
            if got == 0:
                if at_boundary and self._end == self._start:
                    return False
                raise ProtocolError(
                    f"connection closed inside a frame ({self._end - self._start} bytes)")
            self._end += got
        return True

    async def _recv_into(self, view: memoryview) -> int:
        if self._socket is not None:
            return await self._socket.recv_into(view)
        data = await self._stream.receive_some(len(view))
        view[:len(data)] = data
        return len(data)
